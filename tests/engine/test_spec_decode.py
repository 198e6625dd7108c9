"""Speculative decoding: every method gives exactly the unspeculated output (greedy fp32,
under preemption, with n=2, stop strings, logprobs and a JSON schema), drafts never
reach the prefix cache, and seeded requests stay reproducible."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.errors import ParamError
from engine.models.decoder import kv_block_bytes
from engine.sampling_params import Constraint
from tests.support.prompts import SENTENCES, make_prompts

SCHEMA = json.dumps({"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
                     "required": ["city", "population"]})
# 36 blocks of 16 tokens cannot hold 14 sequences of up to ~100 tokens: preemption is forced.
BLOCKS = 36


def _requests(tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    """Open prompts, prompts that quote themselves (so n-gram and suffix proposals get
    accepted), and one request for each feature that must survive speculation."""
    prompts = make_prompts(tokenizer, 8, 40)
    quote = [tokenizer.encode(SENTENCES[i] + " " + SENTENCES[i + 1] + " " + SENTENCES[i], add_special_tokens=False)
             for i in (0, 4, 12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    params = [greedy] * (len(prompts) + len(quote))
    prompts += quote
    prompts += [quote[0], prompts[1], prompts[2], prompts[3]]
    params += [SamplingParams(temperature=0.0, max_tokens=32, n=2),
               SamplingParams(temperature=0.0, max_tokens=32, stop=["fibonacci", "lamp"]),
               SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),
               SamplingParams(temperature=0.0, max_tokens=32, structured=Constraint("json", SCHEMA))]
    return prompts, params


def _run(tokenizer, model_dir, **spec) -> tuple[list, object]:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    llm = LLM(None, dtype="float32", max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256,
              kv_cache_memory_bytes=BLOCKS * kv_block_bytes(hf_config, 16, torch.float32), **spec)
    prompts, params = _requests(tokenizer)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.stats()


@pytest.fixture(scope="module")
def baseline(tokenizer, default_model_dir):
    return _run(tokenizer, default_model_dir)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "suffix", "num_speculative_tokens": 4},
    {"method": "draft", "num_speculative_tokens": 3},  # the identical model
], ids=["ngram", "suffix", "draft"])
def test_speculation_changes_nothing_in_greedy_output(baseline, tokenizer, default_model_dir, spec):
    want, base_stats = baseline
    got, stats = _run(tokenizer, default_model_dir, speculative_config=spec)
    assert base_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert stats.blocks_free == stats.blocks_total  # rejected slots and the draft's blocks all came back
    assert stats.spec_method == spec["method"]
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1]
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    # rejections were exercised (the identical draft's come from the grammar, which it does not apply)
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    if spec["method"] == "draft":
        assert stats.spec_acceptance_rate > 0.9
    for i, (w, g) in enumerate(zip(want, got)):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], f"request {i} diverged"
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
    stop, lps, js = got[-3].outputs[0], got[-2].outputs[0], got[-1].outputs[0]
    assert stop.finish_reason == "stop" and stop.stop_reason in ("fibonacci", "lamp")
    for a, b in zip(lps.logprobs, want[-2].outputs[0].logprobs):
        # the same tokens; the values come from other kernels' fp32 rounding (a k+1-row
        # query through the prefill path, not the decode path: 1.05e-5 apart seen here)
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
    if js.finish_reason == "stop":
        assert set(json.loads(js.text)) == {"city", "population"}


def test_drafts_never_reach_the_prefix_cache(tokenizer):
    """While sequences speculate, every block published to the prefix cache hashes tokens the
    sequence really has; rejected drafts leave no trace there."""
    llm = LLM(None, dtype="float32", max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    engine = llm.engine
    prompts, _ = _requests(tokenizer)
    for i, p in enumerate(prompts[:6]):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    kv = engine.kv_manager
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            published = kv._published.get(seq.seq_id, 0)
            assert published * kv.block_size <= seq.num_tokens
            fresh = type(seq)(seq.seq_id, seq.request_id, 0, seq.prompt_token_ids, seq.params, seq.max_tokens,
                              token_ids=list(seq.token_ids), cache_salt=seq.cache_salt)
            assert kv._hashes(fresh, published * kv.block_size) == seq.block_hashes[:published]
            checked += 1
    assert checked and llm.stats().spec_num_draft_tokens > llm.stats().spec_num_accepted_tokens
    # beam search forks sequences every step, which speculation's drafts cannot follow: refused by name
    with pytest.raises(ParamError) as err:
        llm.beam_search([prompts[0]], BeamSearchParams(2, 8))
    assert err.value.param == "use_beam_search" and not engine.has_unfinished()


@pytest.mark.parametrize("spec", [{"method": "ngram", "prompt_lookup_min": 1}, {"method": "draft", "num_layers": 6}],
                         ids=["ngram", "draft"])
def test_a_seeded_request_gives_the_same_text_whatever_shares_its_batch(tokenizer, spec):
    prompts = make_prompts(tokenizer, 4, 32)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    llm = LLM(None, dtype="float32", max_model_len=256, speculative_config=spec)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(prompts, [seeded, others, others, others], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == crowd
    assert llm.stats().spec_num_drafts > 0
    if spec["method"] == "ngram":  # deterministic proposals take one uniform per emitted token
        plain = LLM(None, dtype="float32", max_model_len=256).generate([prompts[0]], seeded, use_tqdm=False)
        assert plain[0].outputs[0].token_ids == alone


def test_impossible_settings_name_their_key(tiny_model_factory):
    tiny = str(tiny_model_factory("spec_target"))
    other = str(tiny_model_factory("spec_other_vocab", vocab_size=1000))
    cases = [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0}),
         "speculative_config.num_speculative_tokens"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 17}),
         "speculative_config.num_speculative_tokens"),
        (dict(speculative_config={"method": "medusa"}), "speculative_config.method"),
        (dict(speculative_config={"method": "ngram", "max_batch_rows": 1}), "speculative_config.max_batch_rows"),
        (dict(speculative_config={"method": "ngram", "lookahead": 2}), "speculative_config.lookahead"),
        (dict(speculative_config={"method": "ngram", "num_layers": 2}), "speculative_config.num_layers"),
        (dict(speculative_config={"method": "draft", "prompt_lookup_max": 2}), "speculative_config.prompt_lookup_max"),
        (dict(speculative_config={"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}),
         "speculative_config.prompt_lookup_max"),
        (dict(speculative_config={"method": "draft", "num_layers": 9}), "speculative_config.num_layers"),
        (dict(speculative_config={"method": "draft", "model": other}), "speculative_config.model"),
        (dict(speculative_config={"method": "draft", "model": "/nonexistent/model"}), "speculative_config.model"),
        (dict(speculative_config={"method": "draft", "quantization": "gguf"}), "speculative_config.quantization"),
        (dict(speculative_config={"method": "ngram"}, pipeline_parallel_size=2), "speculative_config"),
    ]
    for kwargs, param in cases:
        with pytest.raises(ParamError) as e:
            LLM(tiny, dtype="float32", **kwargs)
        assert e.value.param == param, (kwargs, e.value.param, str(e.value))
