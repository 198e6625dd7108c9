"""With several API keys, each key is a tenant: what one stores or caches, another must
not read, continue, delete, evict or detect.

APIKeyMiddleware sets the caller's tenant for the request's duration: a hash of the key
it matched (the key itself is never kept beside the data), or None where the server has
no keys and so one tenant. Stored responses carry it as their owner, and the prefix
cache is salted with it, so `cached_tokens` can no longer confirm, one block at a time,
that another caller sent a given system prompt.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from engine.serving.errors import APIError

TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)

PrefixCacheScope = Literal["per_key", "shared"]


def tenant_of(key: bytes) -> str:
    return hashlib.sha256(b"pagedserve-tenant:" + key).hexdigest()[:32]


def cache_salt(client_salt: str | None, scope: PrefixCacheScope = "per_key") -> str | None:
    """The salt a request's prompt blocks are hashed with: the caller's tenant, then the
    client's own salt (which splits a tenant's cache further). `shared` is the operator's
    choice of one cache for every key, where the keys belong to one party."""
    tenant = TENANT.get() if scope == "per_key" else None
    if tenant is None:
        return client_salt
    return tenant if client_salt is None else f"{tenant}:{client_salt}"


class KeyQuota:
    """At most `limit` requests in flight per tenant on the model routes: past it, 429. One
    client opening hundreds of streams otherwise takes every place in the waiting queue,
    and every other key gets 429s until they finish."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.in_flight: dict[str, int] = {}

    async def run(self, tenant: str | None, call: Callable[[], Awaitable[Any]],
                  refuse: Callable[[APIError], Awaitable[Any]]) -> Any:
        if self.limit is None or tenant is None:
            return await call()
        held = self.in_flight.get(tenant, 0)
        if held >= self.limit:
            return await refuse(APIError(429, f"this API key already has {held} requests in flight (the bound is "
                                         f"{self.limit} per key); retry when one finishes", "rate_limit_error",
                                         None, "key_concurrency", {"Retry-After": "1"}))
        self.in_flight[tenant] = held + 1
        try:
            return await call()
        finally:
            left = self.in_flight[tenant] - 1
            if left:
                self.in_flight[tenant] = left
            else:
                del self.in_flight[tenant]
