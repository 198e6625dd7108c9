"""Block tables per sequence on top of the block pool, and the prefix cache lookups.

A sequence's table grows only when its tokens cross a block boundary. Full blocks are
published to the prefix cache when they are scheduled: their tokens are known, and
the forward pass writes every layer's KV before any attention reads it, so a sequence
admitted in the same step may already share them.

A model's layers may be split into groups (engine/kv_groups.py), each with its own table
per sequence over the one pool. In a group whose layers attend within a sliding window,
a block whose tokens all lie before the window of the step's first new token can never
be read again: it goes back to the pool (still a prefix-cache entry until evicted) and
its table entry becomes DROPPED. A Mistral v0.1 sequence so holds at most the window's
blocks, and a Gemma sequence's local layers hold only theirs while its global layers
keep everything.
"""

from __future__ import annotations

import hashlib

from engine.block_pool import Block, BlockPool, hash_block
from engine.sequence import Sequence
from engine.state_slots import StateSlots


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A table entry whose block went back to the pool: outside its group's window. The
# kernels never read it; block_ids() gives it a valid id (0) so layouts stay checkable.
DROPPED = Block(-1, ref_cnt=1 << 30)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,), state_slots: int = 0) -> None:
        self.block_size = block_size
        # A model with linear-attention layers: a state slot per running sequence besides its
        # blocks (engine/state_slots.py). Cached blocks cannot restore a state, so such a
        # model has no prefix cache (engine/config.py says so when it is asked for).
        self.states = StateSlots(state_slots) if state_slots else None
        enable_caching = enable_caching and self.states is None
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.windows = windows  # per group: the window its layers attend within; None: everything
        self.num_groups = len(windows)
        # Per group, per sequence: the table, and how many of its leading entries are DROPPED.
        self.group_tables: list[dict[int, list[Block]]] = [{} for _ in windows]
        self._dropped: list[dict[int, int]] = [{} for _ in windows]
        self.tables = self.group_tables[0]
        self._published: dict[int, int] = {}
        # (src, dst) block pairs to copy before the next forward: copy-on-write of
        # partly filled blocks that forked sequences still share.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def window(self) -> int | None:
        """The window of a single-group layout (all layers alike); None otherwise."""
        return self.windows[0] if self.num_groups == 1 else None

    # -- prefix cache -------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Hashes of the sequence's full blocks among its first num_tokens tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            extra = seq.cache_salt.encode() if (i == 0 and seq.cache_salt) else b""
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    @staticmethod
    def _key(block_hash: bytes, group: int) -> bytes:
        """A group's cache key for a block of tokens: the same tokens in another group's
        layers are other KV."""
        return block_hash if group == 0 else hashlib.sha256(block_hash + group.to_bytes(2, "little")).digest()

    def find_cached(self, seq: Sequence) -> list[Block]:
        """The longest run of blocks that starts the sequence's known tokens and that every
        group has cached; group 0's blocks (allocate finds the others' by the same keys).

        The last known token is never served from the cache: its logits are needed. Nor is
        anything of a request that wants prompt logprobs, or a mean-pooled embedding: they
        come from computing the whole prompt.
        """
        if not self.enable_caching or seq.params.prompt_logprobs is not None or seq.pool == "mean":
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in self._hashes(seq, seq.num_tokens)[:limit]:
            block = self.pool.lookup(h)
            if block is None or any(self.pool.lookup(self._key(h, g)) is None for g in range(1, self.num_groups)):
                break
            hits.append(block)
        return hits

    # -- allocation ---------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new: int, cached: list[Block] | tuple[()] = ()) -> bool:
        """Make room for num_new more tokens (after any cached ones) in every group. False
        if the pool is short."""
        bs = self.block_size
        hits = [list(cached)] + [self._group_hits(seq, g, len(cached)) for g in range(1, self.num_groups)]
        tables = [t.get(seq.seq_id, []) for t in self.group_tables]
        for g, table in enumerate(tables):
            self._drop_outside_window(g, seq, table, seq.num_computed_tokens)
        total = seq.num_computed_tokens + len(cached) * bs + num_new
        need = max(cdiv(total, bs) - len(tables[0]) - len(cached), 0)  # the same count in every group
        cows = [self._needs_copy(seq, table) for table in tables]
        revive = sum(1 for group in hits for b in group if b.ref_cnt == 0)
        if need * self.num_groups + revive + sum(cows) > self.pool.num_free:
            return False
        if self.states is not None:
            if not self.states.can_hold(seq.seq_id):
                return False
            self.states.take(seq.seq_id)
        for g, table in enumerate(tables):
            if cows[g]:
                old = table[-1]
                table[-1] = self.pool.allocate(1)[0]
                self.pending_copies.append((old.id, table[-1].id))
                self.pool.release([old])
            self.pool.touch(hits[g])
            table.extend(hits[g])
            if need:
                table.extend(self.pool.allocate(need))
            self.group_tables[g][seq.seq_id] = table
        if self.enable_caching:
            self._publish(seq, tables, min(total, seq.num_tokens))
        if cached:
            for g, table in enumerate(tables):
                self._drop_outside_window(g, seq, table, seq.num_computed_tokens + len(cached) * bs)
        return True

    def _group_hits(self, seq: Sequence, group: int, count: int) -> list[Block]:
        """Group `group`'s blocks for the first `count` cached blocks find_cached vouched for."""
        hits = []
        for h in seq.block_hashes[:count]:
            block = self.pool.lookup(self._key(h, group))
            assert block is not None, "find_cached checked every group"
            hits.append(block)
        return hits

    def _drop_outside_window(self, group: int, seq: Sequence, table: list[Block], first_new: int) -> None:
        """Release the blocks no query from position first_new on can see: query p sees keys
        (p - window, p], so block i is done once (i + 1) * block_size <= first_new - window + 1."""
        window = self.windows[group]
        if window is None:
            return
        dropped = self._dropped[group]
        done = dropped.get(seq.seq_id, 0)
        end = min(len(table) - 1, (first_new - window + 1) // self.block_size)  # never the last block
        if end <= done:
            return
        self.pool.release(reversed(table[done:end]))
        table[done:end] = [DROPPED] * (end - done)
        dropped[seq.seq_id] = end

    def _needs_copy(self, seq: Sequence, table: list[Block]) -> bool:
        """Writing into a partly filled block that a forked sibling also holds."""
        return bool(table) and seq.num_computed_tokens % self.block_size != 0 and table[-1].ref_cnt > 1

    def _publish(self, seq: Sequence, tables: list[list[Block]], num_tokens: int) -> None:
        done = self._published.get(seq.seq_id, 0)
        full = num_tokens // self.block_size
        if full <= done:
            return
        hashes = self._hashes(seq, num_tokens)
        for g, table in enumerate(tables):
            for i in range(done, full):
                if table[i] is not DROPPED:
                    self.pool.cache(table[i], self._key(hashes[i], g))
        self._published[seq.seq_id] = full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child share every block of parent; a later write to a shared partial block copies it."""
        for tables, dropped in zip(self.group_tables, self._dropped):
            table = tables.get(parent.seq_id, [])  # none while a preempted parent waits
            skip = dropped.get(parent.seq_id, 0)
            self.pool.touch(table[skip:])
            tables[child.seq_id] = list(table)
            dropped[child.seq_id] = skip
        self._published[child.seq_id] = self._published.get(parent.seq_id, 0)
        child.block_hashes = list(parent.block_hashes)
        if self.states is not None:
            self.states.fork(parent.seq_id, child.seq_id)

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks, tail first, so a chain's tail is evicted before its head."""
        for tables, dropped in zip(self.group_tables, self._dropped):
            table = tables.pop(seq.seq_id, [])
            self.pool.release(reversed(table[dropped.pop(seq.seq_id, 0):]))
        self._published.pop(seq.seq_id, None)
        if self.states is not None:
            self.states.release(seq.seq_id)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_state_copies(self) -> list[tuple[int, int]]:
        """(src, dst) state slots to copy before the next forward: forks' states."""
        return self.states.take_copies() if self.states is not None else []

    def state_slot(self, seq: Sequence) -> int:
        assert self.states is not None
        return self.states.slot(seq.seq_id)

    # -- introspection ------------------------------------------------------------
    def block_ids(self, seq: Sequence, group: int = 0) -> list[int]:
        table = self.group_tables[group].get(seq.seq_id, [])
        dropped = self._dropped[group].get(seq.seq_id, 0)
        return [0] * dropped + [b.id for b in table[dropped:]]

    def num_blocks_held(self, seq: Sequence) -> int:
        """Blocks of the pool the sequence holds, over every group (shared ones count for
        each holder)."""
        return sum(len(t.get(seq.seq_id, ())) - d.get(seq.seq_id, 0)
                   for t, d in zip(self.group_tables, self._dropped))

    def num_stored(self, seq: Sequence) -> int:
        """Token slots whose KV the sequence holds, over every group."""
        return sum(seq.num_computed_tokens - d.get(seq.seq_id, 0) * self.block_size for d in self._dropped)

    def num_slots(self, seq: Sequence) -> int:
        """KV slots allocated to the sequence (shared blocks count for each holder)."""
        return self.num_blocks_held(seq) * self.block_size

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
