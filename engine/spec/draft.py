"""A draft model: the target in a cheaper form (quantized, or its first layers) proposes
k tokens one at a time; the target checks them in one pass.

Its KV cache has as many blocks as the target's and is addressed by the same block
tables, so it is allocated, copied on write and freed with the sequence's own blocks:
nothing is kept in step by hand. What it holds for a sequence is its first
`num_draft_computed` positions (no further than the target's computed count: past that,
a position held a rejected token). Before proposing it catches up on the positions it
lacks (a new prompt, or a token the target added), then decodes k - 1 more; all of them
fall within the slots the scheduler gave the step's speculative tokens.

A draft's KV only steers what is proposed, never what is accepted: a stale entry costs
acceptance, not correctness.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.cdf import inverse_cdf
from engine.kv_cache_manager import KVCacheManager
from engine.runner import ModelRunner, StepTensors, flatten
from engine.sampler import filtered_probs
from engine.sequence import Sequence


class DraftProposer:
    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager, generator: torch.Generator) -> None:
        self.runner = runner
        self.kv = kv_manager
        self.generator = generator  # for unseeded requests' draws

    def propose(self, seqs: list[Sequence], allow: list[int], copies: list[tuple[int, int]]) -> None:
        tables = [self.kv.block_ids(s) for s in seqs]
        starts = [min(s.num_draft_computed, s.num_computed_tokens) for s in seqs]
        # the step's copies-on-write apply to this cache too, before anything reads it
        logits = self._forward([s.token_ids[c:] for s, c in zip(seqs, starts)], starts, tables, copies)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = list(range(len(seqs)))
        for j in range(max(allow)):
            toks, sampled, q = self._draw([seqs[i] for i in live], logits)
            for row, i in enumerate(live):
                drafts[i].append(toks[row])
            for n, row in enumerate(sampled):
                probs[live[row]].append(q[n])  # type: ignore[index]
            live = [i for i in live if allow[i] > j + 1]
            if not live:
                break
            logits = self._forward([[drafts[i][-1]] for i in live], [seqs[i].num_tokens + j for i in live],
                                   [tables[i] for i in live])
        for seq, toks, qs in zip(seqs, drafts, probs):
            seq.spec_token_ids = toks
            seq.spec_probs = torch.stack(qs) if qs else None
            seq.num_draft_computed = seq.num_tokens + len(toks) - 1

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor | None]:
        """The draft's next token per row: its argmax for a greedy request, else a draw from
        its own distribution under the request's temperature, top-k, top-p and min-p; with
        the sampled rows and their distributions (None when every row is greedy)."""
        tokens = logits.argmax(dim=-1)
        sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return tokens.tolist(), sampled, None
        q = filtered_probs(logits[sampled].float(), [seqs[r].params for r in sampled])
        u = torch.cat([torch.rand(1, generator=seqs[r].generator or self.generator, dtype=torch.float64)
                       for r in sampled])
        tokens[sampled] = inverse_cdf(q, u)
        return tokens.tolist(), sampled, q

    def _forward(self, tokens: list[list[int]], first: list[int], tables: list[list[int]],
                 copies: list[tuple[int, int]] = ()) -> torch.Tensor:
        """The draft's logits after each sequence's tokens (single-token queries run first,
        as the decode kernel wants); rows in the order given."""
        order = sorted(range(len(tokens)), key=lambda i: len(tokens[i]) != 1)
        ids, positions, slots, table_np, starts = flatten([tokens[i] for i in order], [first[i] for i in order],
                                                          [tables[i] for i in order], self.kv.block_size)
        lens = np.array([first[i] + len(tokens[i]) for i in order], dtype=np.int64)
        step = StepTensors(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots), block_tables=torch.from_numpy(table_np),
            query_start_loc=torch.from_numpy(starts.astype(np.int64)), seq_lens=torch.from_numpy(lens),
            logits_indices=torch.from_numpy((starts[1:] - 1).astype(np.int64)),
            copies=torch.tensor(list(copies), dtype=torch.int64).view(-1, 2),
            num_decodes=sum(len(t) == 1 for t in tokens))
        out = self.runner.forward(step)
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return out[back]

    def finish(self, seq: Sequence) -> None:
        pass
