"""Valid but extreme requests against the offline engine: values at the edge of float32, lists
of a size no client sends, and an engine fault. None may stall the core, emit a token outside
the vocabulary, or leave the offline API hanging."""

from __future__ import annotations

import time

import pytest

from engine import LLM, EngineDeadError, ParamError, SamplingParams
from engine import limits

pytestmark = pytest.mark.engine

VOCAB = 32000  # Llama 2's: not a multiple of the inverse CDF's 1,024-token blocks


@pytest.fixture(scope="module")
def odd_vocab(tiny_model_factory):
    model = tiny_model_factory("vocab-32000", vocab_size=VOCAB, tie_word_embeddings=False)
    with LLM(str(model), dtype="float32", max_model_len=256, max_num_seqs=8) as llm:
        yield llm


def run(llm: LLM, **kw) -> list[int]:
    params = SamplingParams(max_tokens=16, ignore_eos=True, **kw)
    return llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_vanishing_temperature_is_greedy_and_the_engine_goes_on(odd_vocab):
    greedy = run(odd_vocab, temperature=0.0)
    for t in (1e-45, 1e-38, 1e-10):
        got = run(odd_vocab, temperature=t, seed=3)
        assert got == greedy and all(0 <= tok < VOCAB for tok in got)
    sampled = run(odd_vocab, temperature=1.0, seed=3)
    assert len(sampled) == 16 and all(0 <= tok < VOCAB for tok in sampled)


@pytest.mark.parametrize("name,value", [("repetition_penalty", 1e-300), ("repetition_penalty", 1e300),
                                        ("temperature", 1e300)])
def test_values_that_overflow_float32_are_refused_naming_the_field(odd_vocab, name, value):
    with pytest.raises(ParamError) as err:
        run(odd_vocab, **{name: value})
    assert err.value.param == name
    assert len(run(odd_vocab, temperature=0.0)) == 16


def test_a_fault_in_a_step_raises_now_and_on_every_later_call(tiny_model_factory, monkeypatch):
    """Once a step has raised, the engine's state is not to be trusted: this call and every
    later one raise EngineDeadError at once, where the next generate used to spin for ever."""
    llm = LLM(str(tiny_model_factory("vocab-32000", vocab_size=VOCAB, tie_word_embeddings=False)),
              dtype="float32", max_model_len=256, max_num_seqs=8)

    def broken(*args, **kwargs):
        raise IndexError("index 32767 is out of bounds for dimension 0 with size 32000")

    monkeypatch.setattr(llm.engine.executor, "result", broken)
    with pytest.raises(EngineDeadError, match="IndexError") as err:
        run(llm, temperature=0.0)
    assert isinstance(err.value.__cause__, IndexError)
    monkeypatch.undo()
    start = time.monotonic()
    for call in (lambda: run(llm, temperature=0.0),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)):
        with pytest.raises(EngineDeadError, match="earlier step"):
            call()
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("field,value", [
    ("stop", ["x"] * (limits.MAX_STOP + 1)),
    ("stop", ["y" * (limits.MAX_STOP_LEN + 1)]),
    ("stop", ["y" * limits.MAX_STOP_LEN] * (limits.MAX_STOP_CHARS // limits.MAX_STOP_LEN + 1)),
    ("bad_words", [f"w{i}" for i in range(limits.MAX_BAD_WORDS + 1)]),
    ("bad_words", ["z" * (limits.MAX_BAD_WORDS_CHARS + 1)]),
    ("stop_token_ids", list(range(limits.MAX_STOP_TOKEN_IDS + 1))),
    ("logit_bias", {i: 1.0 for i in range(limits.MAX_LOGIT_BIAS + 1)}),
    ("allowed_token_ids", [1] * (limits.MAX_ALLOWED_TOKEN_IDS + 1)),
])
def test_a_list_past_its_bound_is_refused_naming_it(field, value):
    with pytest.raises(ParamError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and "at most" in str(err.value)
    assert len(str(err.value)) < 400  # the message never echoes the whole list

