"""The msgpack codec for engine/messages.py's types, for the pipe to the engine process.

Every message is one tagged msgspec struct, encoded as an array. SamplingParams cross as
the fields they were validated with in this process, and the engine process rebuilds
them without checking again (SamplingParams.trusted).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.messages import AbortRequest, AddRequest, Command, Event, GetStats, Stop
from engine.sampling_params import SamplingParams


class _AddFields(msgspec.Struct, tag="add", array_like=True):
    """AddRequest as it arrives: the params still as their fields."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    cache_salt: str | None = None
    priority: int = 0


_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(_AddFields | AbortRequest | GetStats | Stop)
_events = msgspec.msgpack.Decoder(Event)


def encode(msg: Command | Event) -> bytes:
    return _encoder.encode(msg)


def decode_command(data: bytes) -> Command:
    cmd = _commands.decode(data)
    if isinstance(cmd, _AddFields):
        return AddRequest(cmd.request_id, cmd.prompt_token_ids, SamplingParams.trusted(cmd.params),
                          cmd.cache_salt, cmd.priority)
    return cmd


def decode_event(data: bytes) -> Event:
    return _events.decode(data)
