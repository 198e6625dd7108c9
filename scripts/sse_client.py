"""A lean streaming HTTP/1.1 client for the load generator.

The load generator shares the server's cores, so every microsecond it spends on an
event is taken from the server it measures. httpx parses each streamed chunk through
several layers of Python (httpcore, h11, its line decoder): at c=64 it took 131-150 us
of CPU per streamed token, this client 73-79 (session 20, benchmarks/LOG.md). It
does one POST per connection and reads the body with plain asyncio streams, splitting
the chunked framing and the SSE events with bytes methods. It speaks just what the
benchmark needs (http://, a JSON body, a chunked or close-delimited streaming reply)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPStatusError(Exception):
    """A reply other than 200, with the start of its body."""


async def _body(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The reply body as it arrives, its chunked framing removed."""
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # the empty trailer
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def sse_post(url: str, body: bytes) -> AsyncIterator[bytes]:
    """POST a JSON body and yield each server-sent event's `data:` payload as it arrives."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// URLs: {url}")
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80, limit=1 << 20)
    try:
        head = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head + body)
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if status != 200:
            text = b"".join([d async for d in _body(reader, chunked)])
            raise HTTPStatusError(f"HTTP {status}: {text[:200]!r}")
        pending = b""
        async for data in _body(reader, chunked):
            pending = (pending + data).replace(b"\r\n", b"\n")  # a CRLF may straddle two reads
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].lstrip(b" ")
    finally:
        writer.close()
