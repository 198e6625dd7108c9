"""The msgpack codec for engine/messages.py's types, for the pipe to the engine process.

Every message is one tagged msgspec struct, encoded as an array. SamplingParams are a
struct too, validated where the request entered (AsyncLLM.generate): the engine process
decodes them as they are and checks only what it alone knows (engine/intake.py).
"""

from __future__ import annotations

import msgspec

from engine.messages import Command, Event

_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_events = msgspec.msgpack.Decoder(Event)


def encode(msg: Command | Event) -> bytes:
    return _encoder.encode(msg)


def decode_command(data: bytes) -> Command:
    return _commands.decode(data)


def decode_event(data: bytes) -> Event:
    return _events.decode(data)
