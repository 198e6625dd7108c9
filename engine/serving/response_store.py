"""Responses created with `store: true`, kept in memory for `previous_response_id` and
GET/DELETE /v1/responses/{id}.

Bounded three ways (service.responses_store in the preset): a count, the bytes of the
stored JSON, and an age; the oldest go first. It lives in the serving process and is
lost on restart, and each replica (or worker) has its own: a follow-up routed to another
replica gets a 404 naming previous_response_id. docs/service.md says so.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stored:
    response: str  # the Response's JSON, as GET returns it
    conversation: list[dict[str, Any]]  # the items that led to it and its output, for the next turn
    size: int
    created: float


class ResponseStore:
    def __init__(self, max_responses: int = 1000, max_bytes: int = 64 << 20, max_age_s: float = 3600.0) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: str, conversation: list[dict[str, Any]], conversation_bytes: int) -> bool:
        """Keep a response; False (and nothing kept) when it alone is past max_bytes."""
        size = len(response) + conversation_bytes
        if size > self.max_bytes:
            return False
        self.delete(rid)
        self._items[rid] = Stored(response, conversation, size, time.monotonic())
        self.bytes += size
        self._evict()
        return True

    def get(self, rid: str) -> Stored | None:
        self._evict()
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        old = self._items.pop(rid, None)
        if old is not None:
            self.bytes -= old.size
        return old is not None

    def _evict(self) -> None:
        horizon = time.monotonic() - self.max_age_s
        while self._items:
            oldest = next(iter(self._items.values()))
            if (len(self._items) <= self.max_responses and self.bytes <= self.max_bytes
                    and oldest.created >= horizon):
                return
            self.delete(next(iter(self._items)))
