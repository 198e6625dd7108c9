"""Speculative decoding's sampler: verified tokens follow the target distribution, and the
draft count shrinks as more sequences run."""

from __future__ import annotations

import math

import pytest
import torch

from engine import SamplingParams
from engine.rejection_sampler import Draft
from engine.sampler import Sampler, SamplingRow, make_generator


def _chi2_fails(counts: torch.Tensor, p: torch.Tensor) -> bool:
    """Pearson's test at p = 1e-4 (a correct sampler fails 1 run in 10,000), with the bins
    expected to hold fewer than 5 counts pooled into one."""
    n = float(counts.sum())
    expected = p * n
    order = torch.argsort(expected, descending=True).tolist()
    big = [i for i in order if expected[i] >= 5]
    small = [i for i in order if expected[i] < 5]
    obs = [float(counts[i]) for i in big] + [float(counts[small].sum())]
    exp = [float(expected[i]) for i in big] + [float(expected[small].sum())]
    if exp[-1] < 5:  # pool the remainder into the smallest real bin
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(obs) - 1
    z = 3.719  # the normal quantile at 1 - 1e-4; Wilson-Hilferty for the chi-square one
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat > critical


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("draft", ["sampled", "deterministic"])
def test_verified_tokens_follow_the_target_distribution(temperature, draft):
    """Known p over 6 tokens; drafts from a deliberately bad q (or a fixed, unlikely token).
    The first emitted token (an accepted draft or its replacement) and the second (after an
    accepted first draft: the next draft or the bonus token) both follow p."""
    vocab, groups, k = 6, 12000, 2  # enough to see a wrong acceptance rule at once; 30,000 cost 18 s
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -8.0])
    p = torch.softmax(logits / temperature, dim=-1)
    q = torch.tensor([0.02, 0.03, 0.05, 0.1, 0.3, 0.5])  # mass where p has little
    gen = make_generator(7)
    params = SamplingParams(temperature=temperature, max_tokens=8)
    rows, drafts = [], []
    if draft == "sampled":
        proposed = torch.multinomial(q.expand(groups * k, vocab), 1, generator=gen).view(groups, k).tolist()
    else:
        proposed = [[2, 0]] * groups
    for toks in proposed:
        drafts.append(Draft(toks, q.expand(k, vocab) if draft == "sampled" else None))
        rows += [SamplingRow(params, None, [1], [], ahead=toks[:j]) for j in range(k + 1)]
    sampler = Sampler([vocab + 1], seed=3)
    verdicts = sampler.verify(logits.expand(len(rows), vocab).contiguous(), rows, drafts)
    first = torch.bincount(torch.tensor([v.token_ids[0] for v in verdicts]), minlength=vocab).double()
    second = torch.bincount(torch.tensor([v.token_ids[1] for v in verdicts if len(v.token_ids) > 1]),
                            minlength=vocab).double()
    for counts in (first, second):
        assert not _chi2_fails(counts, p.double()), (counts / counts.sum(), p)
    accepted = sum(v.num_accepted > 0 for v in verdicts) / groups
    expect = float((torch.minimum(p, q)).sum()) if draft == "sampled" else float(p[2])
    assert abs(accepted - expect) < 4 * math.sqrt(expect * (1 - expect) / groups) + 1e-3


@pytest.mark.parametrize("running,allowed", [(1, 4), (2, 4), (3, 3), (4, 2), (6, 1), (7, 0), (12, 0)])
def test_max_batch_rows_gives_fewer_drafts_as_more_sequences_run(running, allowed):
    """Each decoding sequence gets min(k, max_batch_rows // running - 1) draft positions,
    so a step's rows stay about max_batch_rows; disable_by_batch_size still applies."""
    from engine.kv_cache_manager import KVCacheManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    def decoding(spec_max_batch: int | None) -> list[int]:
        kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
        sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=256, num_spec=4,
                          spec_max_batch=spec_max_batch, spec_max_rows=12)
        for i in range(running):
            sched.add(Sequence(i, str(i), 0, [5, 6, 7], SamplingParams(max_tokens=32), 32))
        for seq, n in zip((b := sched.schedule()).seqs, b.num_new):  # the prompts
            seq.num_computed_tokens += n
            seq.token_ids.append(8)  # each sampled one token: one to compute, room for drafts
        batch = sched.schedule()
        assert len(batch.seqs) == running and batch.num_new == [1 + a for a in batch.spec_allow]
        return batch.spec_allow

    assert decoding(None) == [allowed] * running
    assert decoding(running - 1) == [0] * running  # past disable_by_batch_size: none at all
