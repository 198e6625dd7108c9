"""Block tables per request on top of the block pool, and the prefix cache lookups.

A request's table grows only when its tokens cross a block boundary. Full blocks are
published to the prefix cache when they are scheduled: their tokens are known, and
the forward pass writes every layer's KV before any attention reads it, so a request
admitted in the same step may already share them.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import Block, BlockPool, hash_block
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.tables: dict[str, list[Block]] = {}
        self._published: dict[str, int] = {}
        # (src, dst) block pairs to copy before the next forward: copy-on-write of
        # partly filled blocks that forked sequences still share.
        self.pending_copies: list[tuple[int, int]] = []

    # -- prefix cache -------------------------------------------------------------
    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks among its first num_tokens tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            extra = req.cache_salt.encode() if (i == 0 and req.cache_salt) else b""
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    def find_cached(self, req: Request) -> list[Block]:
        """The longest run of cached blocks that starts the request's known tokens.

        The last known token is never served from the cache: its logits are needed.
        """
        if not self.enable_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in self._hashes(req, req.num_tokens)[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation ---------------------------------------------------------------
    def allocate(self, req: Request, num_new: int, cached: Sequence[Block] = ()) -> bool:
        """Make room for num_new more tokens (after any cached ones). False if the pool is short."""
        bs = self.block_size
        table = self.tables.get(req.request_id, [])
        total = req.num_computed_tokens + len(cached) * bs + num_new
        need = cdiv(total, bs) - len(table) - len(cached)
        cow = self._needs_copy(req, table)
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
        self.tables[req.request_id] = table
        if self.enable_caching:
            self._publish(req, table, min(total, req.num_tokens))
        return True

    def _needs_copy(self, req: Request, table: list[Block]) -> bool:
        """Writing into a partly filled block that a forked sibling also holds."""
        return bool(table) and req.num_computed_tokens % self.block_size != 0 and table[-1].ref_cnt > 1

    def _publish(self, req: Request, table: list[Block], num_tokens: int) -> None:
        done = self._published.get(req.request_id, 0)
        full = num_tokens // self.block_size
        if full <= done:
            return
        hashes = self._hashes(req, num_tokens)
        for i in range(done, full):
            self.pool.cache(table[i], hashes[i])
        self._published[req.request_id] = full

    def fork(self, parent: Request, child: Request) -> None:
        """Let child share every block of parent; a later write to a shared partial block copies it."""
        table = self.tables[parent.request_id]
        self.pool.touch(table)
        self.tables[child.request_id] = list(table)
        self._published[child.request_id] = self._published.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def free(self, req: Request) -> None:
        """Return the request's blocks, tail first, so a chain's tail is evicted before its head."""
        table = self.tables.pop(req.request_id, [])
        self._published.pop(req.request_id, None)
        self.pool.release(reversed(table))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- introspection ------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.id for b in self.tables.get(request_id, [])]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
