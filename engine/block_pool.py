"""The pool of KV blocks: free list, reference counts and the prefix-cache index.

A block with ref_cnt 0 is free. A free block may still hold a cached prefix (it keeps
its hash) and can be revived by a cache hit until it is handed out again. The free
list is ordered for eviction: blocks go to its tail when freed and leave from its
head, so the least recently used cached block is the first to be overwritten.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    id: int
    ref_cnt: int = 0
    hash: bytes | None = None


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """A chained, collision-resistant hash: equal hashes mean equal token prefixes.

    SHA-256 over (parent hash, tokens, extra keys such as a tenant's cache salt), so a
    collision, which would silently serve another prefix's KV, is not a practical risk.
    """
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(len(extra).to_bytes(4, "little") + extra)
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, Block] = {}
        self.enable_caching = enable_caching
        # Kept up to date on every change, so reading them never scans the pool.
        self.num_shared = 0  # blocks with more than one reference
        self.num_cached_free = 0  # free blocks that still hold a reusable prefix
        self.num_evictions = 0  # cached prefixes overwritten to make room, since start

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[Block]:
        """Hand out n blocks, evicting the least recently used cached ones first."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self.free)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self.free.popitem(last=False)[0]]
            if block.hash is not None:
                self.num_cached_free -= 1
                self.num_evictions += 1
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the cache, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.id]
                if block.hash is not None:
                    self.num_cached_free -= 1
            elif block.ref_cnt == 1:
                self.num_shared += 1
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; give the caller's order as eviction order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 1:
                self.num_shared -= 1
            elif block.ref_cnt == 0:
                self.free[block.id] = None
                if block.hash is not None:
                    self.num_cached_free += 1

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Publish a block computed from a full run of tokens as a prefix-cache entry."""
        if not self.enable_caching or block.hash is not None:
            return
        if block_hash in self.cached:
            return  # the same content already lives in another block; keep that one
        block.hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
            block.hash = None

    def reset_cache(self) -> None:
        """Forget every cached prefix; blocks in use keep their contents but are no longer hits."""
        for block in self.cached.values():
            block.hash = None
        self.cached.clear()
        self.num_cached_free = 0
