"""Valid but extreme requests against the offline engine: values at the edge of float32, lists
of a size no client sends, and an engine fault. None may stall the core, emit a token outside
the vocabulary, or leave the offline API hanging."""

from __future__ import annotations

import json
import time

import pytest

from engine import LLM, EngineDeadError, ParamError, SamplingParams, limits
from engine.sampling_params import Constraint


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
    for call in (lambda: run(llm, temperature=0.0),  # raises, where it used to spin for ever
                 lambda: llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)):
        with pytest.raises(EngineDeadError, match="earlier step"):
            call()


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
        SamplingParams(**{field: value}).validate()
    assert err.value.param == field and "at most" in str(err.value)
    assert len(str(err.value)) < 400  # the message never echoes the whole list


def slow_schema(n: int) -> str:
    """Optional properties: xgrammar's compile time grows faster than linearly in them."""
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}})


def test_a_constraint_that_compiles_too_slowly_fails_alone_and_fast_the_second_time(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("vocab-32000", vocab_size=VOCAB, tie_word_embeddings=False)),
              dtype="float32", max_model_len=256, max_num_seqs=8, grammar_compile_timeout_s=0.2)
    slow = SamplingParams(max_tokens=4, structured=Constraint("json", slow_schema(1000)))
    with pytest.raises(ParamError, match="did not compile within 0.2 s") as err:
        llm.generate([[5, 6, 7]], slow, use_tqdm=False)
    assert err.value.param == "structured_outputs"
    with pytest.raises(ParamError, match="did not compile"):
        llm.generate([[5, 6, 7]], slow, use_tqdm=False)
    with pytest.raises(ParamError, match="did not compile"):  # remembered: refused on submission, no wait
        llm.engine.grammars.submit(slow.structured)
    assert len(run(llm, temperature=0.0)) == 16
    huge = SamplingParams(max_tokens=4, structured=Constraint("json", slow_schema(3000)))
    with pytest.raises(ParamError, match="at most 65536 are accepted") as err:
        llm.generate([[5, 6, 7]], huge, use_tqdm=False)
    assert err.value.param == "structured_outputs"


def test_the_core_steps_others_while_a_constraint_compiles(tiny_model_factory):
    """EngineCore's loop with the compile on its own thread: a plain request queued behind
    a slow constraint finishes while that one is still compiling."""
    from engine.core import EngineCore
    from engine.engine import LLMEngine
    from engine.config import EngineConfig
    from engine.messages import AddRequest, Added, StepOutput, Stop

    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_factory("vocab-32000", vocab_size=VOCAB,
                                                                        tie_word_embeddings=False)),
                                           dtype="float32", max_model_len=256, max_num_seqs=8,
                                           grammar_compile_timeout_s=60))
    events: list = []
    cmds = [AddRequest("slow", [5, 6, 7], SamplingParams(max_tokens=4, structured=Constraint("json", slow_schema(1200)))),
            AddRequest("plain", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))]

    def source(timeout: float) -> list:
        if cmds:
            return [cmds.pop(0)]
        finished = {d.request_id for e in events if isinstance(e, StepOutput) for d in e.outputs if d.finished}
        if "plain" in finished:
            return [Stop()]
        time.sleep(timeout)
        return []

    EngineCore(engine, events.append).run(source)
    added = [e.request_id for e in events if isinstance(e, Added)]
    assert added == ["plain"], added  # the slow one is still compiling when the plain one is done
    assert engine.compiles


def test_a_constraint_queued_behind_a_slow_one_is_not_remembered_as_slow(tiny_model_factory):
    """The compile thread busy with a slow schema: a small one waiting behind it past its
    deadline fails as busy, and compiles at once when sent again later."""
    from engine.structured import Grammars

    from transformers import AutoTokenizer

    model = tiny_model_factory("vocab-32000", vocab_size=VOCAB, tie_word_embeddings=False)
    grammars = Grammars(AutoTokenizer.from_pretrained(model), VOCAB, [2], timeout_s=0.2)
    slow, small = Constraint("json", slow_schema(800)), Constraint("json", slow_schema(2))
    held = grammars.submit(slow)
    behind = grammars.submit(small)
    deadline = time.monotonic() + 0.2
    with pytest.raises(ParamError, match="busy with others"):
        grammars.result(small, behind, deadline, wait=True)
    held.result(timeout=120)  # the slow one finishes on its own
    assert grammars.compile(small) is not None  # not blacklisted: it compiles now
