"""The contract between the engine core and its clients (engine/messages.py): every
message type survives the codec, params cross without being checked again, and errors
cross with their field."""

from __future__ import annotations


import pytest

from engine.client import wire
from engine.errors import ParamError
from engine.messages import (AbortRequest, Added, AddRequest, CompletionDelta, Died, ErrorInfo, GetStats, ModelInfo,
                             Ready, RequestDelta, RequestMetrics, StatsReply, StepOutput, Stop, Stopped,
                             TokenLogprobs)
from engine.sampling_params import SamplingParams, Constraint
from engine.stats import EngineStats, StepStats

STATS = EngineStats(blocks_total=64, blocks_free=60, blocks_used=4, blocks_shared=1, blocks_cached_free=2,
                    kv_cache_usage=0.0625, kv_waste=0.1, kv_waste_mean=0.2, num_preemptions=3, num_running=2,
                    num_waiting=1, prefix_cache_query_tokens=100, prefix_cache_hit_tokens=32,
                    prompt_tokens_computed=68, generation_tokens=40)
PARAMS = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, seed=2**63, max_tokens=None, stop=["\n\n"],
                        stop_token_ids=[7], logprobs=3, logit_bias={11: -100.0, 49151: 2.5}, allowed_token_ids=[1, 2],
                        structured=Constraint("regex", "[a-z]+"), prompt_logprobs=1, bad_words=["no"])
LPS = [TokenLogprobs(5, -0.25, 1, [(5, -0.25), (9, -1.5)]), TokenLogprobs(9, -2.0, 3, [])]
DELTA = RequestDelta("req-1", 12, [CompletionDelta(0, "héllo ✓", [5, 9], LPS, "stop", "\n\n", None),
                                   CompletionDelta(1, "", [], None, "abort", None, "no token is left")],
                     True, 2, 4, RequestMetrics(1.5, 1.75, 2.0, 3.25), [None, *LPS], ["stop", "abort"])

COMMANDS = [AddRequest("req-1", [1, 2, 3], PARAMS, "salt", -2), AddRequest("r", [0], SamplingParams()),
            AbortRequest("req-1"), GetStats(), Stop()]
EVENTS = [Ready(ModelInfo("SmolLM2", "HuggingFaceTB/SmolLM2-135M-Instruct", 2048, 49152, {"temperature": 0.2},
                          STATS)),
          Added("req-1"), Added("req-2", ErrorInfo("max_tokens is too large", "max_tokens")),
          StepOutput([DELTA, RequestDelta("r", 1, [], False)], StepStats(generation_tokens=2, num_running=1,
                                                                            kv_cache_usage=0.5)),
          StatsReply(STATS), Stopped(), Died("WorkerDiedError: engine-rank1 exited")]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_survives_the_codec(cmd):
    assert wire.decode_command(wire.encode(cmd)) == cmd


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_survives_the_codec(event):
    assert wire.decode_event(wire.encode(event)) == event


def test_params_cross_as_validated_and_are_not_checked_again(monkeypatch):
    data = wire.encode(COMMANDS[0])

    def checked_again(self):
        raise AssertionError("SamplingParams validated a second time in the engine process")

    monkeypatch.setattr(SamplingParams, "validate", checked_again)
    got = wire.decode_command(data)
    assert got.params == PARAMS and isinstance(got.params.structured, Constraint)


def test_errors_cross_with_their_field():
    err = wire.decode_event(wire.encode(Added("r", ErrorInfo.of(ParamError("n", "n (9) exceeds max_num_seqs")))))
    exc = err.error.exception()
    assert isinstance(exc, ParamError) and exc.param == "n" and "max_num_seqs" in str(exc)
    engine_fault = wire.decode_event(wire.encode(Added("r", ErrorInfo.of(RuntimeError("grammar cache")))))
    assert type(engine_fault.error.exception()) is RuntimeError
