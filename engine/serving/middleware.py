"""The ASGI middlewares in front of the routes: request ids and the API key on every route, and the typed
BentoML routes' body and deadline guard."""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from typing import Any

from starlette.requests import Request

from engine.serving import tracing
from engine.serving import jsontext
from engine.serving.deadlines import deadline, deadline_exceeded
from engine.serving.errors import APIError, anthropic_error_response, bad_request, error_response, speaks_anthropic
from engine.serving.parsing import DEFAULT_MAX_BODY, read_body
from engine.serving.tenancy import TENANT, KeyQuota, tenant_of

API_KEY_ENV = "LLM_API_KEY"
# Everything that spends the model's or the tokenizer's time (vLLM leaves /tokenize open; a
# chat template over an 8 MiB body is work enough to stall a server, so here it needs the key).
PROTECTED_PREFIXES = ("/v1/", "/generate", "/chat", "/tokenize", "/detokenize")
OPS_PREFIXES = ("/stats", "/metrics")  # behind the key too when the preset says so
REQUEST_ID_HEADER = "X-Request-Id"


class RequestIdMiddleware:
    """X-Request-Id: the client's (bounded, printable) or a new one; echoed on every answer
    (a 401 or a typed route's too: the service puts this outermost) and current while the
    request runs, so logs and its span carry it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.lower().encode(), b"").decode("latin-1")
        rid = given if 0 < len(given) <= 128 and given.isascii() and given.isprintable() else uuid.uuid4().hex
        token = tracing.REQUEST_ID.set(rid)

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            tracing.REQUEST_ID.reset(token)


class APIKeyMiddleware:
    """With $LLM_API_KEY set (one key, or several separated by commas, so keys can be
    rotated), model routes and the tokenizer routes need `Authorization: Bearer <key>`
    (or `x-api-key: <key>`, as Anthropic's clients send it); else 401, in the route's
    API's error shape. `protect_ops` puts /stats and /metrics behind the key too; /health stays
    open for probes. CORS preflights (OPTIONS) pass: browsers send them without
    credentials, and the CORS middleware outside this one answers them.

    Each key is a tenant (engine/serving/tenancy.py): the request runs with its tenant
    set, and at most `max_in_flight_per_key` of one key's requests run at once.

    A variable that is set but holds no key (empty, blanks, commas) is refused at start:
    read as "no keys", it would have served every caller unauthenticated."""

    def __init__(self, app: Any, protect_ops: bool = False, max_in_flight_per_key: int | None = None) -> None:
        self.app = app
        raw = os.environ.get(API_KEY_ENV)
        self.keys = [k.strip().encode("utf-8") for k in (raw or "").split(",") if k.strip()]
        if raw is not None and not self.keys:
            raise ValueError(f"{API_KEY_ENV} is set but holds no key ({raw!r}): unset it to serve without "
                             "authentication, or give one or more keys separated by commas")
        self.tenants = [tenant_of(k) for k in self.keys]
        self.prefixes = PROTECTED_PREFIXES + (OPS_PREFIXES if protect_ops else ())
        self.quota = KeyQuota(max_in_flight_per_key)

    def tenant(self, token: bytes) -> str | None:
        """The tenant whose key the header's bytes are (a non-ASCII key is its UTF-8 bytes),
        or None: compared with every key in constant time, so timing tells nothing."""
        given = token.strip()
        hits = [secrets.compare_digest(given, key) for key in self.keys]
        return next((t for t, hit in zip(self.tenants, hits) if hit), None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (self.keys and scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"].startswith(self.prefixes)):
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer":
                token = headers.get(b"x-api-key", b"")
            tenant = self.tenant(token) if token else None
            render = anthropic_error_response if speaks_anthropic(scope["path"]) else error_response
            if tenant is None:
                resp = render(APIError(401, "Incorrect API key provided; send `Authorization: Bearer <key>` or "
                                       "`x-api-key: <key>`.", "invalid_request_error", None, "invalid_api_key"))
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
            reset = TENANT.set(tenant)
            try:
                await self.quota.run(tenant, lambda: self.app(scope, receive, send),
                                     lambda err: render(err)(scope, receive, send))
            finally:
                TENANT.reset(reset)
            return
        await self.app(scope, receive, send)


class TypedRouteGuard:
    """The typed BentoML routes (/generate, /chat) parse their own bodies, so they get the
    OpenAI routes' guards here, in front of BentoML: the body limit (413), JSON bounded as
    every body is (jsontext: depth, NaN, 64-bit integers, valid Unicode; 400 in OpenAI's
    shape), and the deadline (the preset's request_timeout or a shorter X-Request-Timeout).
    A deadline that passes before the answer starts is a 408; one that passes mid-stream
    ends the stream there. Either way the route's task is cancelled, which aborts its
    request in the engine."""

    def __init__(self, app: Any, paths: tuple[str, ...] = ("/generate", "/chat"),
                 max_body_bytes: int = DEFAULT_MAX_BODY, request_timeout: float | None = None) -> None:
        self.app = app
        self.paths = paths
        self.max_body = max_body_bytes
        self.request_timeout = request_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") not in self.paths:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            timeout = deadline(request, self.request_timeout)
            body = await read_body(request, self.max_body)
            if not isinstance(await jsontext.loads_async(body), dict):
                raise bad_request("the request body must be a JSON object")
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        started = False

        async def watch(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await asyncio.wait_for(self.app(scope, replay, watch), timeout)
        except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11, the floor
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await error_response(deadline_exceeded(timeout))(scope, receive, send)
