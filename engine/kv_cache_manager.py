"""Block tables per sequence on top of the block pool, and the prefix cache lookups.

A sequence's table grows only when its tokens cross a block boundary. Full blocks are
published to the prefix cache when they are scheduled: their tokens are known, and
the forward pass writes every layer's KV before any attention reads it, so a sequence
admitted in the same step may already share them.

Where every layer attends within a sliding window (Mistral v0.1, windowed Phi-3), a block
whose tokens all lie before the window of the step's first new token can never be read
again: it goes back to the pool (still a prefix-cache entry until evicted) and its table
entry becomes DROPPED, so a sequence holds at most the window's blocks however long it grows.
"""

from __future__ import annotations

from engine.block_pool import Block, BlockPool, hash_block
from engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A table entry whose block went back to the pool: outside every layer's window. The
# kernels never read it; block_ids() gives it a valid id (0) so layouts stay checkable.
DROPPED = Block(-1, ref_cnt=1 << 30)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 window: int | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.window = window  # every layer's window is at most this; None: some layer sees everything
        self._dropped: dict[int, int] = {}  # leading DROPPED entries per sequence
        self.tables: dict[int, list[Block]] = {}
        self._published: dict[int, int] = {}
        # (src, dst) block pairs to copy before the next forward: copy-on-write of
        # partly filled blocks that forked sequences still share.
        self.pending_copies: list[tuple[int, int]] = []

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

    def find_cached(self, seq: Sequence) -> list[Block]:
        """The longest run of cached blocks that starts the sequence's known tokens.

        The last known token is never served from the cache: its logits are needed. Nor is
        anything of a request that wants prompt logprobs: they come from computing the prompt.
        """
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in self._hashes(seq, seq.num_tokens)[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation ---------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new: int, cached: list[Block] | tuple[()] = ()) -> bool:
        """Make room for num_new more tokens (after any cached ones). False if the pool is short."""
        bs = self.block_size
        table = self.tables.get(seq.seq_id, [])
        self._drop_outside_window(seq, table, seq.num_computed_tokens)
        total = seq.num_computed_tokens + len(cached) * bs + num_new
        need = cdiv(total, bs) - len(table) - len(cached)
        cow = self._needs_copy(seq, table)
        revive = sum(1 for b in cached if b.ref_cnt == 0)
        if max(need, 0) + revive + cow > self.pool.num_free:
            return False
        if cow:
            old = table[-1]
            table[-1] = self.pool.allocate(1)[0]
            self.pending_copies.append((old.id, table[-1].id))
            self.pool.release([old])
        self.pool.touch(cached)
        table.extend(cached)
        if need > 0:
            table.extend(self.pool.allocate(need))
        self.tables[seq.seq_id] = table
        if self.enable_caching:
            self._publish(seq, table, min(total, seq.num_tokens))
        if cached:
            self._drop_outside_window(seq, table, seq.num_computed_tokens + len(cached) * bs)
        return True

    def _drop_outside_window(self, seq: Sequence, table: list[Block], first_new: int) -> None:
        """Release the blocks no query from position first_new on can see: query p sees keys
        (p - window, p], so block i is done once (i + 1) * block_size <= first_new - window + 1."""
        if self.window is None:
            return
        done = self._dropped.get(seq.seq_id, 0)
        end = min(len(table) - 1, (first_new - self.window + 1) // self.block_size)  # never the last block
        if end <= done:
            return
        self.pool.release(reversed(table[done:end]))
        table[done:end] = [DROPPED] * (end - done)
        self._dropped[seq.seq_id] = end

    def _needs_copy(self, seq: Sequence, table: list[Block]) -> bool:
        """Writing into a partly filled block that a forked sibling also holds."""
        return bool(table) and seq.num_computed_tokens % self.block_size != 0 and table[-1].ref_cnt > 1

    def _publish(self, seq: Sequence, table: list[Block], num_tokens: int) -> None:
        done = self._published.get(seq.seq_id, 0)
        full = num_tokens // self.block_size
        if full <= done:
            return
        hashes = self._hashes(seq, num_tokens)
        for i in range(done, full):
            self.pool.cache(table[i], hashes[i])
        self._published[seq.seq_id] = full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child share every block of parent; a later write to a shared partial block copies it."""
        table = self.tables.get(parent.seq_id, [])  # none while a preempted parent waits
        dropped = self._dropped.get(parent.seq_id, 0)
        self.pool.touch(table[dropped:])
        self.tables[child.seq_id] = list(table)
        self._dropped[child.seq_id] = dropped
        self._published[child.seq_id] = self._published.get(parent.seq_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks, tail first, so a chain's tail is evicted before its head."""
        table = self.tables.pop(seq.seq_id, [])
        self._published.pop(seq.seq_id, None)
        self.pool.release(reversed(table[self._dropped.pop(seq.seq_id, 0):]))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- introspection ------------------------------------------------------------
    def block_ids(self, seq: Sequence) -> list[int]:
        table = self.tables.get(seq.seq_id, [])
        dropped = self._dropped.get(seq.seq_id, 0)
        return [0] * dropped + [b.id for b in table[dropped:]]

    def num_blocks_held(self, seq: Sequence) -> int:
        """Blocks of the pool the sequence holds (shared ones count for each holder)."""
        return len(self.tables.get(seq.seq_id, ())) - self._dropped.get(seq.seq_id, 0)

    def num_stored(self, seq: Sequence) -> int:
        """Computed tokens whose KV the sequence still holds."""
        return seq.num_computed_tokens - self._dropped.get(seq.seq_id, 0) * self.block_size

    def num_slots(self, seq: Sequence) -> int:
        """KV slots allocated to the sequence (shared blocks count for each holder)."""
        return self.num_blocks_held(seq) * self.block_size

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
