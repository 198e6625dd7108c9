"""The offline API on the embedded model: stopping, sampling, logprobs, n, errors, stats."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams


PROMPT = "The three most important inventions in human history are"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512,
               kv_cache_memory_bytes=200 * 737280)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def one(llm: LLM, prompt, params: SamplingParams):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_outputs_come_back_in_input_order_with_prompt_fields(llm):
    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,"]
    outs = llm.generate(prompts, greedy(max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt)
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert "Paris" in outs[1].outputs[0].text


def test_token_id_prompts_and_per_prompt_params(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    a, b = llm.generate([ids, ids], [greedy(max_tokens=3), greedy(max_tokens=6)], use_tqdm=False)
    assert a.prompt is None and a.prompt_token_ids == ids
    assert len(a.outputs[0].token_ids) == 3 and len(b.outputs[0].token_ids) == 6
    assert b.outputs[0].token_ids[:3] == a.outputs[0].token_ids


def test_stop_string_is_never_in_the_text(llm):
    full = one(llm, PROMPT, greedy(max_tokens=40)).outputs[0].text
    stop = full[10:14]
    assert stop.strip(), full
    out = one(llm, PROMPT, greedy(max_tokens=40, stop=[stop, "zzzz-never"])).outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_ids_and_eos(llm):
    full = one(llm, PROMPT, greedy(max_tokens=20)).outputs[0]
    tok = full.token_ids[5]
    out = one(llm, PROMPT, greedy(max_tokens=20, stop_token_ids=[tok])).outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok


def test_min_tokens_holds_back_eos_and_ignore_eos_runs_to_max(llm):
    chat = llm.apply_chat_template([{"role": "user", "content": "Reply with just the word: yes"}])
    short = one(llm, chat, greedy(max_tokens=64)).outputs[0]
    assert short.finish_reason == "stop" and short.stop_reason is None  # ended on eos
    assert short.token_ids[-1] in llm.engine.eos_token_ids
    n = len(short.token_ids) + 8
    held = one(llm, chat, greedy(max_tokens=64, min_tokens=n)).outputs[0]
    assert len(held.token_ids) >= n
    assert not set(held.token_ids[: n - 1]) & set(llm.engine.eos_token_ids)
    ignored = one(llm, chat, greedy(max_tokens=40, ignore_eos=True)).outputs[0]
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"


def test_logprobs_follow_the_openai_shape(llm):
    out = one(llm, PROMPT, greedy(max_tokens=6, logprobs=3)).outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.rank == 1  # greedy picks the most likely
        assert len(lp.top) == 3 and lp.top[0][0] == tok
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert lp.logprob == pytest.approx(values[0])
    assert one(llm, PROMPT, greedy(max_tokens=2)).outputs[0].logprobs is None


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = one(llm, PROMPT, p).outputs[0].token_ids
    others = [SamplingParams(temperature=1.2, max_tokens=30), greedy(max_tokens=10)]
    batch = llm.generate(["Once upon a time", PROMPT, "def main():"], [others[0], p, others[1]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = one(llm, PROMPT, SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24))
    assert other_seed.outputs[0].token_ids != alone


def test_n_sequences_share_the_prompt_and_differ(llm):
    out = one(llm, PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3 and all(len(s) == 16 for s in seqs)
    again = one(llm, PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    assert llm.stats().blocks_free == llm.stats().blocks_total


def test_chat_applies_the_template(llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(conv, greedy(max_tokens=12), use_tqdm=False)
    assert out.prompt_token_ids[0] == llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert "Paris" in out.outputs[0].text
    two = llm.chat([conv, [{"role": "user", "content": "Say hello."}]], greedy(max_tokens=4), use_tqdm=False)
    assert len(two) == 2


def test_impossible_requests_fail_at_once_and_disturb_nothing(llm):
    too_long = list(range(10, 10 + 600))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long], greedy(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["hi"], greedy(max_tokens=600), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], SamplingParams(top_p=0), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi", "there"], [greedy(max_tokens=2), SamplingParams(temperature=-1)], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], greedy(max_tokens=4), use_tqdm=False)
    stats = llm.stats()
    assert stats.blocks_free == stats.blocks_total and stats.num_waiting == 0
    assert "Paris" in one(llm, "The capital of France is", greedy(max_tokens=4)).outputs[0].text


def test_abort_frees_blocks_mid_generation(llm):
    eng = llm.engine
    eng.add_request("long", PROMPT, greedy(max_tokens=200, ignore_eos=True))
    eng.add_request("short", "Hello", greedy(max_tokens=3))
    for _ in range(4):
        eng.step()
    assert eng.stats().blocks_used > 0
    out = eng.abort("long")
    assert out.finished and out.deltas[0].finish_reason == "abort" and out.finish_reasons == ["abort"]
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().blocks_free == eng.stats().blocks_total


def test_stats_report_pool_and_waste(tokenizer):
    """Paging wastes at most the unfilled tail of each sequence's last block: under 4% of
    the KV memory at realistic lengths (prompts of 250-400 tokens here), as promised."""
    from tests.support.prompts import make_prompts

    fresh = LLM(None, dtype="float32", max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=512,
                kv_cache_memory_bytes=400 * 737280)
    prompts = [p for i, length in enumerate(range(250, 410, 20)) for p in make_prompts(tokenizer, 1, length + i)]
    fresh.generate(prompts, greedy(max_tokens=24, ignore_eos=True), use_tqdm=False)
    s = fresh.stats()
    assert s.blocks_total == 400 and s.blocks_free == 400 and s.num_preemptions == 0
    assert s.generation_tokens == 24 * len(prompts)
    assert 0 < s.kv_waste_mean < 0.04


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="max_num_seqz"):
        EngineConfig.create(max_num_seqz=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.create(max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.create(block_size=12)
    with pytest.raises(ValueError, match="not found"):
        EngineConfig.from_preset("no-such-preset")
