"""Unknown request fields (service.unknown_fields): a 400 or dropped and named, with the
names a client controls escaped, cut short and counted."""

from __future__ import annotations

import json

import pytest


def test_unknown_fields_are_a_400_or_dropped_and_named():
    from engine.serving.parsing import parse
    from engine.serving.errors import APIError
    from engine.serving.openai.protocol import ChatCompletionRequest, CompletionRequest

    body = json.dumps({"prompt": "hi", "frobnicate": 1, "stream_options": {"include_usage": True, "x": 2}}).encode()
    with pytest.raises(APIError) as err:
        parse(body, CompletionRequest, "reject")
    assert err.value.status == 400 and err.value.detail.param in ("frobnicate", "stream_options.x")
    req, ignored = parse(body, CompletionRequest, "warn")
    assert sorted(ignored) == ["frobnicate", "stream_options.x"] and req.stream_options.include_usage
    # inside a union member (content parts) too, and a wrong type is still a 400 under warn
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]}
    req, ignored = parse(json.dumps(chat).encode(), ChatCompletionRequest, "warn")
    assert ignored == ["messages[0].content[0].cache_control"] and req.messages[0].text() == "hi"
    with pytest.raises(APIError) as err:
        parse(json.dumps({"prompt": "hi", "n": "2", "extra": 1}).encode(), CompletionRequest, "warn")
    assert err.value.detail.param == "n"


def test_ignored_field_names_are_escaped_cut_and_counted():
    """The names are the client's text: a CR/LF forged log lines and broke the header, a
    non-Latin-1 one made the header a 500 after the whole generation."""
    from engine.serving.parsing import MAX_SHOWN_FIELD, shown_fields

    shown = shown_fields(["a\r\nX-Evil: 1", "caf\u00e9\u4e2d", "k" * 10_000] + [f"f{i}" for i in range(40)])
    shown.encode("latin-1")  # a valid header value
    assert "\r" not in shown and "\n" not in shown and shown.isprintable()
    assert "k" * (MAX_SHOWN_FIELD + 1) not in shown and shown.endswith("(and 27 more)")
