"""The Responses API's store keeps to its three bounds, oldest out first."""

from __future__ import annotations

import pytest

from engine.serving.response_store import ResponseStore

pytestmark = pytest.mark.unit


def test_the_oldest_go_first_past_the_count_or_the_bytes():
    store = ResponseStore(max_responses=2, max_bytes=100)
    for rid in ("a", "b", "c"):
        assert store.put(rid, "x" * 10, [], 0)
    assert store.get("a") is None and store.get("b") and store.get("c") and len(store) == 2
    assert store.put("d", "x" * 75, [], 20)  # 95 bytes: nothing else fits beside it
    assert [r for r in "bcd" if store.get(r)] == ["d"] and store.bytes == 95
    assert not store.put("e", "x" * 101, [], 0) and store.get("e") is None  # alone past the bound: not kept
    assert store.delete("d") and not store.delete("d") and store.bytes == 0


def test_responses_expire_after_max_age(monkeypatch):
    import engine.serving.response_store as mod

    now = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_age_s=60)
    store.put("old", "{}", [], 0)
    now[0] += 30
    store.put("new", "{}", [], 0)
    now[0] += 31
    assert store.get("old") is None and store.get("new") is not None
