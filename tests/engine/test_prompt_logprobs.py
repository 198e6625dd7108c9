"""Prompt logprobs against transformers, and bad_words, on the engine directly."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.support.prompts import make_prompts

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def llm():
    # A 48-token budget splits each 100-token prompt into chunks, so prompt logprobs cross steps.
    return LLM(None, dtype="float32", max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256,
               kv_cache_memory_bytes=32 << 20)


def test_prompt_logprobs_match_transformers_across_chunks_and_a_warm_prefix_cache(llm, hf_default, tokenizer):
    prompts = make_prompts(tokenizer, 3, 100)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts[:1], params, use_tqdm=False)[0]  # its blocks are cached by now
    with torch.no_grad():
        ref = torch.log_softmax(hf_default(torch.tensor(prompts)).logits.float(), dim=-1)
    for out, ids, lp in zip(first, prompts, ref):
        got = out.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        for pos, entry in enumerate(got[1:], start=1):
            assert entry.token_id == ids[pos]
            assert entry.logprob == pytest.approx(lp[pos - 1, ids[pos]].item(), abs=1e-4)
            # The rank as transformers' logits give it, where no other token lies within the
            # logprob tolerance of this one; a near-tie may fall either way.
            own = lp[pos - 1, ids[pos]]
            surely_above = int((lp[pos - 1] > own + 1e-4).sum())
            maybe_above = int((lp[pos - 1] > own - 1e-4).sum()) - 1  # less the token itself
            assert surely_above + 1 <= entry.rank <= maybe_above + 1
            want_top = lp[pos - 1].topk(3)
            assert [t for t, _ in entry.top] == want_top.indices.tolist()
    assert again.num_cached_tokens == 0  # the cache would leave no logits for the prompt
    assert [e.logprob for e in again.prompt_logprobs[1:]] == [e.logprob for e in first[0].prompt_logprobs[1:]]
    assert llm.stats().blocks_used == 0


def test_a_step_scores_at_most_its_bound_of_prompt_positions(tokenizer, monkeypatch):
    """Each scored position is a row of logits over the whole vocabulary: prompts asking
    for prompt_logprobs are computed PROMPT_LOGPROB_ROWS positions a step, in all, and a
    plain request beside them still takes the rest of the budget."""
    from engine import scheduler
    from engine.engine import LLMEngine
    from engine.config import EngineConfig

    monkeypatch.setattr(scheduler, "PROMPT_LOGPROB_ROWS", 40)
    engine = LLMEngine(EngineConfig.create(dtype="float32", max_num_seqs=8, max_num_batched_tokens=256,
                                           max_model_len=256, kv_cache_memory_bytes=32 << 20,
                                           enable_prefix_caching=False))
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    first, second = make_prompts(tokenizer, 2, 100)
    engine.add_request("scored-0", first, scored)
    engine.add_request("plain", make_prompts(tokenizer, 1, 120)[0], SamplingParams(temperature=0, max_tokens=1))
    engine.add_request("scored-1", second, scored)
    rows, plain_first = [], None
    real = engine.scheduler.schedule

    def watch(*args):
        batch = real(*args)
        rows.append(sum(scheduler._scored(s, n) for s, n in zip(batch.seqs, batch.num_new)))
        return batch

    engine.scheduler.schedule = watch
    outs = {}
    while engine.has_unfinished():
        for d in engine.step().outputs:
            outs[d.request_id] = d
            if d.request_id == "plain" and plain_first is None:
                plain_first = len(rows)
    assert max(rows) == 40 and sum(rows) == 2 * 99  # every position scored, 40 a step at most
    assert plain_first == 1  # its whole prompt in the first step, beside the first scored chunk
    assert all(len(outs[f"scored-{i}"].prompt_logprobs) == 100 for i in range(2))


def test_bad_words_are_never_generated(llm, tokenizer):
    prompt = "The capital of France is"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in free
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris", "Lyon"]),
                          use_tqdm=False)[0].outputs[0].text
    assert "Paris" not in banned and "Lyon" not in banned and banned != free
