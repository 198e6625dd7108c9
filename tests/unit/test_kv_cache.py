"""Block pool and KV cache manager: allocation at block boundaries, freeing, ref counts."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool, hash_block
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence
from engine.sampling_params import SamplingParams


_seq_ids = itertools.count()


def req(rid: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(next(_seq_ids), rid, 0, tokens, SamplingParams(max_tokens=8), 8, cache_salt=salt)


def step(kv: KVCacheManager, r: Sequence, n: int) -> bool:
    """Schedule n tokens for r and mark them computed, as the engine would."""
    ok = kv.allocate(r, n)
    if ok:
        r.num_computed_tokens += n
    return ok


def test_blocks_are_allocated_only_at_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r = req("a", list(range(5)))
    assert step(kv, r, 5)
    assert len(kv.tables[r.seq_id]) == 2  # 5 tokens -> 2 blocks
    for tok in (100, 101, 102):  # positions 5, 6, 7 fill block 2
        r.token_ids.append(tok)
        assert step(kv, r, 1)
        assert len(kv.tables[r.seq_id]) == 2
    r.token_ids.append(103)  # position 8 starts block 3
    assert step(kv, r, 1)
    assert len(kv.tables[r.seq_id]) == 3
    assert kv.pool.num_free == 5


def test_free_on_finish_returns_every_block():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    a, b = req("a", list(range(9))), req("b", list(range(4)))
    assert step(kv, a, 9) and step(kv, b, 4)
    assert kv.pool.num_free == 2
    kv.free(a)
    assert kv.pool.num_free == 5
    kv.free(b)
    assert kv.pool.num_free == 6
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    a = req("a", list(range(12)))
    assert step(kv, a, 12)
    b = req("b", list(range(4)))
    assert not kv.allocate(b, 4)
    assert b.seq_id not in kv.tables and kv.pool.num_free == 0


def test_abort_mid_prefill_frees_blocks_in_the_scheduler():
    from engine.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    r = req("a", list(range(30)))
    sched.add(r)
    batch = sched.schedule()
    assert batch.num_new == [8] and kv.pool.num_free == 8
    sched.finish(r)  # aborted before its prompt is done
    assert kv.pool.num_free == 10 and not sched.has_work()


def test_ref_counts_with_shared_prefix_and_fork():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", list(range(10)))
    assert step(kv, a, 10)  # blocks: 2 full (published) + 1 partial
    b = req("b", list(range(9)))  # same first 8 tokens
    hits = kv.find_cached(b)
    assert [blk.id for blk in hits] == kv.block_ids(a)[:2]
    assert kv.allocate(b, 1, hits)
    b.num_computed_tokens = 9
    assert [blk.ref_cnt for blk in kv.tables[a.seq_id]] == [2, 2, 1]
    c = req("c", list(range(10)))
    c.num_computed_tokens = 10
    kv.fork(a, c)
    assert [blk.ref_cnt for blk in kv.tables[a.seq_id]] == [3, 3, 2]
    # c writes position 10 into the shared partial block: copy on write.
    c.token_ids.append(7)
    assert step(kv, c, 1)
    (src, dst), = kv.take_copies()
    assert src == kv.tables[a.seq_id][2].id and dst == kv.tables[c.seq_id][2].id and src != dst
    assert kv.tables[a.seq_id][2].ref_cnt == 1
    for r in (a, b, c):
        kv.free(r)
    assert kv.pool.num_free == 10


def test_never_reuses_the_last_prompt_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", list(range(8)))
    assert step(kv, a, 8)
    kv.free(a)
    again = req("a2", list(range(8)))
    assert len(kv.find_cached(again)) == 1  # 8 tokens cached, but the 8th must be recomputed
    longer = req("a3", list(range(9)))
    assert len(kv.find_cached(longer)) == 2


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", list(range(9)), salt="tenant-1")
    assert step(kv, a, 9)
    assert kv.find_cached(req("b", list(range(9)), salt="tenant-2")) == []
    assert kv.find_cached(req("c", list(range(9)))) == []
    assert len(kv.find_cached(req("d", list(range(9)), salt="tenant-1"))) == 2


def test_lru_eviction_takes_tails_before_heads():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    h = None
    for blk in blocks:
        h = hash_block(h, [blk.id])
        pool.cache(blk, h)
    pool.release(reversed(blocks))  # tail first, as the manager frees
    (fresh,) = pool.allocate(1)
    assert fresh.id == 3  # the never-cached block goes first
    (evicted,) = pool.allocate(1)
    assert evicted is blocks[2] and evicted.hash is None
    assert pool.lookup(hash_block(None, [blocks[0].id])) is blocks[0]


def test_hashes_chain_and_differ_by_content():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert hash_block(a, [5]) != hash_block(None, [5])
    assert hash_block(None, [1], b"x") != hash_block(None, [1])


ops = st.lists(
    st.tuples(st.sampled_from(["new", "grow", "free", "fork"]), st.integers(0, 7), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_random_workload_keeps_ref_counts_consistent_and_leaks_nothing(ops, caching):
    """Random allocate/share/fork/free/evict: counts always match the tables, no block
    is handed out while in use, and everything is free at the end."""
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_caching=caching)
    live: dict[str, Sequence] = {}
    serial = 0
    for op, pick, n in ops:
        names = sorted(live)
        if op == "new":
            serial += 1
            # small vocabulary so prefixes repeat and the cache gets hits
            r = req(f"r{serial}", [(pick + i // 5) % 3 for i in range(n)])
            hits = kv.find_cached(r)
            num = r.num_tokens - len(hits) * 4
            if kv.allocate(r, num, hits):
                r.num_computed_tokens = r.num_tokens
                live[r.request_id] = r
        elif op == "grow" and names:
            r = live[names[pick % len(names)]]
            r.token_ids.extend([pick % 3] * n)
            if not step(kv, r, n):
                r.token_ids = r.token_ids[: r.num_computed_tokens]
        elif op == "free" and names:
            kv.free(live.pop(names[pick % len(names)]))
        elif op == "fork" and names:
            parent = live[names[pick % len(names)]]
            serial += 1
            child = req(f"r{serial}", list(parent.prompt_token_ids))
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent, child)
            live[child.request_id] = child
        kv.take_copies()
        # invariants
        refs = [0] * kv.pool.num_blocks
        by_seq = {r.seq_id: r for r in live.values()}
        for seq_id, table in kv.tables.items():
            assert len(table) * 4 >= by_seq[seq_id].num_computed_tokens
            for blk in table:
                refs[blk.id] += 1
        assert refs == [blk.ref_cnt for blk in kv.pool.blocks]
        assert all((blk.ref_cnt == 0) == (blk.id in kv.pool.free) for blk in kv.pool.blocks)
        for h, blk in kv.pool.cached.items():
            assert blk.hash == h
        # the pool's running counts equal a full scan
        assert kv.pool.num_shared == sum(blk.ref_cnt > 1 for blk in kv.pool.blocks)
        assert kv.pool.num_cached_free == sum(blk.hash is not None for blk in kv.pool.blocks if blk.ref_cnt == 0)
    for r in list(live.values()):
        kv.free(r)
    assert kv.pool.num_free == kv.pool.num_blocks
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
