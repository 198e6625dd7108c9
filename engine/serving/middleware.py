"""The ASGI middlewares the service puts in front of every route: request ids and the API key."""

from __future__ import annotations

import os
import secrets
import uuid
from typing import Any

from engine.client import tracing
from engine.serving.errors import APIError, error_response
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
    rotated), model routes and the tokenizer routes need `Authorization: Bearer <key>`;
    else 401. `protect_ops` puts /stats and /metrics behind the key too; /health stays
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
            tenant = self.tenant(token) if scheme.lower() == b"bearer" else None
            if tenant is None:
                resp = error_response(APIError(401, "Incorrect API key provided; send `Authorization: Bearer "
                                               "<key>`.", "invalid_request_error", None, "invalid_api_key"))
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
            reset = TENANT.set(tenant)
            try:
                await self.quota.run(tenant, lambda: self.app(scope, receive, send),
                                     lambda err: error_response(err)(scope, receive, send))
            finally:
                TENANT.reset(reset)
            return
        await self.app(scope, receive, send)
