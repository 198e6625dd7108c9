"""Requests whose own constraints leave no token to sample: refused up front where the
parameters alone show it, ended with finish_reason "abort" and an error where only
decoding shows it; never a made-up token (argmax over all -inf is token 0)."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.errors import ParamError
from engine.sampling_params import Constraint


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("conflict-tiny")), device="cpu", dtype="float32", max_model_len=64,
               kv_cache_memory_bytes=8 << 20)


def yes_no(llm: LLM) -> tuple[list[int], list[int]]:
    tok = llm.tokenizer
    return tok.encode("yes", add_special_tokens=False), tok.encode("no", add_special_tokens=False)


def test_allowed_ids_that_are_all_stop_tokens_under_min_tokens_are_refused(llm):
    eos = llm.engine.eos_token_ids[0]
    with pytest.raises(ParamError, match="min_tokens") as err:
        llm.generate(["hi"], SamplingParams(allowed_token_ids=[eos, 7], stop_token_ids=[7], min_tokens=2),
                     use_tqdm=False)
    assert err.value.param == "allowed_token_ids"
    # the same ids without min_tokens are a fine request: the first token ends it
    out = llm.generate(["hi"], SamplingParams(allowed_token_ids=[eos], max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [eos]


def test_allowed_ids_that_bad_words_all_ban_are_refused(llm):
    yes, no = yes_no(llm)
    assert len(yes) == 1 and len(no) == 1
    with pytest.raises(ParamError, match="bad_words") as err:
        llm.generate(["hi"], SamplingParams(allowed_token_ids=yes + no, bad_words=["yes", "no"]), use_tqdm=False)
    assert err.value.param == "allowed_token_ids"
    assert llm.stats().blocks_used == 0


def test_a_grammar_that_forbids_every_allowed_token_aborts_with_an_error(llm):
    yes, no = yes_no(llm)
    params = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=no,
                            structured=Constraint("choice", json.dumps(["yes"])))
    out = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "abort" and out.token_ids == [] and out.text == ""
    assert "allowed_token_ids" in out.error and "structured-output" in out.error
    # the next request is not disturbed, and nothing is left allocated
    ok = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(ok.token_ids) == 3
    assert llm.stats().blocks_used == 0 and llm.stats().num_running == 0
