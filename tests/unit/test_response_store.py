"""The Responses API's store keeps to its three bounds, oldest out first."""

from __future__ import annotations

import sys


from engine.serving.responses.store import ResponseStore


def size(text: str) -> int:
    """What the store counts for a response of this text and an empty conversation."""
    return sys.getsizeof(text) + sys.getsizeof(b"")


def test_the_oldest_go_first_past_the_count_or_the_bytes():
    small = size("x" * 10)
    store = ResponseStore(max_responses=2, max_bytes=3 * small)
    for rid in ("a", "b", "c"):
        assert store.put(rid, "x" * 10, b"")
    assert store.get("a") is None and store.get("b") and store.get("c") and len(store) == 2
    big = "x" * (3 * small - size("") - small // 2)  # nothing else fits beside it
    assert store.put("d", big, b"")
    assert [r for r in "bcd" if store.get(r)] == ["d"] and store.bytes == size(big)
    assert not store.put("e", "x" * 3 * small, b"") and store.get("e") is None  # alone past the bound: not kept
    assert store.delete("d") and not store.delete("d") and store.bytes == 0


def test_a_response_is_its_owners_alone():
    """Another key's id does not exist for this key: not read, continued or deleted."""
    store = ResponseStore()
    store.put("r", "{}", b"[]", owner="alice")
    assert store.get("r", "alice") is not None
    assert store.get("r", "bob") is None and store.get("r") is None
    assert not store.delete("r", "bob") and store.get("r", "alice") is not None
    assert store.delete("r", "alice") and store.get("r", "alice") is None


def test_a_key_past_its_share_evicts_its_own_never_anothers():
    store = ResponseStore(max_responses=100, max_responses_per_key=3, max_bytes_per_key=10 * size("x" * 10))
    store.put("bob-1", "{}", b"[]", owner="bob")
    for i in range(50):
        assert store.put(f"alice-{i}", "x" * 10, b"", owner="alice")
    assert store.get("bob-1", "bob") is not None
    assert [i for i in range(50) if store.get(f"alice-{i}", "alice")] == [47, 48, 49]
    # the bytes share too: one large response pushes out the owner's older ones
    assert store.put("alice-big", "x" * (9 * size("x" * 10)), b"", owner="alice")
    assert store.get("alice-49", "alice") is None and store.get("bob-1", "bob") is not None
    # a server without keys is one tenant, held to the store's own bounds alone
    for i in range(10):
        store.put(f"anon-{i}", "{}", b"[]")
    assert all(store.get(f"anon-{i}") is not None for i in range(10))


def test_sizes_are_memory_not_characters():
    """Text outside Latin-1 takes up to four bytes a character in memory."""
    store = ResponseStore()
    store.put("a", "\U0001f600" * 1000, b"")
    assert store.bytes >= 4000


def test_responses_expire_after_max_age_and_a_sweep_drops_them_without_an_access(monkeypatch):
    import engine.serving.responses.store as mod

    now = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_age_s=60)
    store.put("old", "{}", b"[]")
    now[0] += 30
    store.put("new", "{}", b"[]")
    now[0] += 31
    assert store.get("old") is None and store.get("new") is not None
    now[0] += 60
    assert len(store) == 1 and store.bytes > 0  # expired, not yet looked at
    store.sweep()
    assert len(store) == 0 and store.bytes == 0


def test_echoed_reasoning_items_are_not_kept():
    """They never reach a prompt, so keeping them stored data no prompt bound limited."""
    from types import SimpleNamespace

    from engine.serving.responses import handler as responses
    from engine.serving.responses.protocol import MessageItem, ReasoningItem, Response, ResponsesRequest

    serving = SimpleNamespace(store=ResponseStore())
    req = ResponsesRequest.model_validate({"input": "hi", "store": True})
    resp = Response(model="m", status="completed")
    big = ReasoningItem(type="reasoning", content=[{"type": "reasoning_text", "text": "r" * 1_000_000}])
    responses._keep(serving, req, resp, [MessageItem(role="user", content="hi"), big])
    assert serving.store.bytes < 10_000
    kept = responses.CONVERSATION.validate_json(serving.store.get(resp.id).conversation)
    assert [type(i).__name__ for i in kept] == ["MessageItem"]
