"""What crosses from the engine core to the serving side, and its msgpack encoding.

An EngineOutput is one request's news from one step: the deltas of the sequences that
changed, whether the request finished, and its timings. It never carries the text or
token ids generated before this step, so the cost of a message does not grow with the
length of the answer. Messages are msgpack arrays whose first item names their kind.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

import msgpack

from engine.errors import ParamError
from engine.outputs import CompletionDelta, RequestMetrics, RequestOutput
from engine.sampler import TokenLogprobs


def pack(msg: list) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)


@dataclass
class EngineOutput:
    request_id: str
    num_prompt_tokens: int
    deltas: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # sent once (RequestOutput says when)

    @classmethod
    def of(cls, out: RequestOutput) -> EngineOutput:
        return cls(out.request_id, len(out.prompt_token_ids), out.deltas, out.finished, out.num_cached_tokens,
                   out.metrics, out.prompt_logprobs)

    def encode(self) -> list:
        return [self.request_id, self.num_prompt_tokens, self.finished, self.num_cached_tokens,
                None if self.metrics is None else astuple(self.metrics),
                [[d.index, d.text, d.token_ids, _encode_logprobs(d.logprobs), d.finish_reason, d.stop_reason, d.error]
                 for d in self.deltas], _encode_logprobs(self.prompt_logprobs)]

    @classmethod
    def decode(cls, item: list) -> EngineOutput:
        rid, n_prompt, finished, cached, metrics, deltas, prompt_lps = item
        return cls(rid, n_prompt,
                   [CompletionDelta(i, text, ids, _decode_logprobs(lps), fin, stop, err)
                    for i, text, ids, lps, fin, stop, err in deltas],
                   finished, cached, None if metrics is None else RequestMetrics(*metrics),
                   _decode_logprobs(prompt_lps))


def _encode_logprobs(lps: list[TokenLogprobs | None] | None) -> list | None:
    if lps is None:
        return None
    return [None if lp is None else [lp.token_id, lp.logprob, lp.rank, [list(t) for t in lp.top]] for lp in lps]


def _decode_logprobs(lps: list | None) -> list | None:
    if lps is None:
        return None
    return [None if lp is None else TokenLogprobs(lp[0], lp[1], lp[2], [(t, v) for t, v in lp[3]]) for lp in lps]


def encode_error(exc: Exception) -> list:
    """A request's error as [bad input?, param or None, message]; a ValueError (ParamError
    among them) stays a bad-input error with its field, anything else is the engine's."""
    param = exc.param if isinstance(exc, ParamError) else None
    return [isinstance(exc, ValueError), param, str(exc) or repr(exc)]


def decode_error(err: list) -> Exception:
    bad_input, param, message = err
    return ParamError(param, message) if bad_input else RuntimeError(message)
