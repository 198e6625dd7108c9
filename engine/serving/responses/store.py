"""Responses created with `store: true`, kept in memory for `previous_response_id` and
GET/DELETE /v1/responses/{id}.

Each response has an owner, the tenant of the API key that created it (tenancy.py): a
response is found, continued or deleted only by its owner, and to any other key it does
not exist (the same 404 as a missing id). Bounded four ways (service.responses_store in
the preset): a count and a memory size per key, where a key past its share loses its
own oldest responses and never another key's; the same two for the whole store; and an
age. Sizes are the memory the stored text takes (the response and the conversation as
JSON, which is how both are kept), not a count of characters. It lives in the serving
process and is lost on restart, and each replica (or worker) has its own: a follow-up
routed to another replica gets a 404 naming previous_response_id. docs/service.md says so.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Stored:
    response: str  # the Response's JSON, as GET returns it
    conversation: bytes  # the items that led to it and its output, as JSON, for the next turn
    owner: str | None  # the tenant that stored it; None where the server has no API keys
    size: int  # bytes of memory the two take
    created: float


class ResponseStore:
    def __init__(self, max_responses: int = 1000, max_bytes: int = 64 << 20, max_age_s: float = 3600.0,
                 max_responses_per_key: int | None = None, max_bytes_per_key: int | None = None) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.max_per_key = max_responses_per_key
        self.max_bytes_per_key = max_bytes_per_key
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._owned: dict[str | None, OrderedDict[str, None]] = {}  # owner -> their ids, oldest first
        self._owner_bytes: dict[str | None, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: str, conversation: bytes, owner: str | None = None) -> bool:
        """Keep a response; False (and nothing kept) when it alone is past a bound on bytes."""
        size = sys.getsizeof(response) + sys.getsizeof(conversation)
        if size > self.max_bytes or (owner is not None and self.max_bytes_per_key is not None
                                     and size > self.max_bytes_per_key):
            return False
        self._drop(rid)
        self._items[rid] = Stored(response, conversation, owner, size, time.monotonic())
        self._owned.setdefault(owner, OrderedDict())[rid] = None
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        self.bytes += size
        self._evict_own(owner)
        self._evict()
        return True

    def get(self, rid: str, owner: str | None = None) -> Stored | None:
        """The response, to its owner only."""
        self._evict()
        stored = self._items.get(rid)
        return stored if stored is not None and stored.owner == owner else None

    def delete(self, rid: str, owner: str | None = None) -> bool:
        """Delete it, if `owner` owns it; False for a missing id and another key's alike."""
        if self.get(rid, owner) is None:
            return False
        self._drop(rid)
        return True

    def sweep(self) -> None:
        """Drop what has expired, without waiting for an access to it: the service calls it
        on every request it generates for, so expired conversations leave memory even on a
        server whose clients never touch the Responses API again."""
        self._evict()

    def _drop(self, rid: str) -> None:
        old = self._items.pop(rid, None)
        if old is None:
            return
        self.bytes -= old.size
        owned = self._owned[old.owner]
        del owned[rid]
        self._owner_bytes[old.owner] -= old.size
        if not owned:
            del self._owned[old.owner], self._owner_bytes[old.owner]

    def _evict_own(self, owner: str | None) -> None:
        """A key past its share loses its own oldest. Without keys (owner None) there is one
        tenant, held to the store's own bounds alone."""
        if owner is None:
            return
        owned = self._owned.get(owner)
        while owned and ((self.max_per_key is not None and len(owned) > self.max_per_key)
                         or (self.max_bytes_per_key is not None and self._owner_bytes[owner] > self.max_bytes_per_key)):
            self._drop(next(iter(owned)))
            owned = self._owned.get(owner)

    def _evict(self) -> None:
        """The whole store past its bounds loses its oldest; every response past its age goes
        (oldest first: they are kept in the order they were stored)."""
        horizon = time.monotonic() - self.max_age_s
        while self._items:
            oldest = next(iter(self._items.values()))
            if (len(self._items) <= self.max_responses and self.bytes <= self.max_bytes
                    and oldest.created >= horizon):
                return
            self._drop(next(iter(self._items)))
