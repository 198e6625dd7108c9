"""scripts/sse_client.py, the serving benchmark's HTTP client: every TTFT and ITL it
reports rests on it splitting a streamed reply into the server's events, whatever the
framing (chunked or not), the line endings or where the reads break."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.server import ROOT


async def _serve(reply: list[bytes]):
    """A one-shot HTTP server that sends `reply` in separate writes, a pause between each."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        seen.append(head + await reader.readexactly(length))
        for part in reply:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _chunked(*parts: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]


async def _collect(reply: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    from sse_client import sse_post

    server, port, seen = await _serve(reply)
    async with server:
        events = [e async for e in sse_post(f"http://127.0.0.1:{port}/v1/completions", b'{"a": 1}')]
    return events, seen


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))


def test_chunked_events_split_anywhere_come_out_whole():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    # An event split across chunks, a CRLF split between two chunks, a comment line, and
    # a field without the optional space.
    body = _chunked(b'data: {"t": "he', b'llo"}\r', b"\n\r\n: keep-alive\n\ndata:{\"t\": 2}\n\ndata: [DONE]\n\n")
    events, seen = asyncio.run(_collect([head, *body]))
    assert events == [b'{"t": "hello"}', b'{"t": 2}', b"[DONE]"]
    request = seen[0]
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert request.endswith(b'\r\n\r\n{"a": 1}')


def test_a_body_delimited_by_close_is_read_to_the_end():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    events, _ = asyncio.run(_collect([head, b"data: 1\n\nda", b"ta: 2\n\n"]))
    assert events == [b"1", b"2"]


def test_an_error_status_raises_with_the_body():
    from sse_client import HTTPStatusError

    head = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    with pytest.raises(HTTPStatusError, match=r"HTTP 400: b'\{\"error\": \"max_tokens\"\}'"):
        asyncio.run(_collect([head, *_chunked(b'{"error": "max_tokens"}')]))
