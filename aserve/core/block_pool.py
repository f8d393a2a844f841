"""BlockPool: the physical KV blocks, their ref counts, the prefix-cache index and an O(1) LRU free list.

A freed block keeps its hash and waits at the tail of the free list, so a later request with the same
prefix can revive it; allocation takes the head (least recently freed) and only then forgets its hash.
"""
from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None  # collision guard for the hash

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the least recently freed block; evict its prefix-cache entry if it had one."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        self.uncache(block_id)
        block.ref_count = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """Add a reference to a block that is in use or sits cached in the free list."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def cache(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Index a full block under its chained hash (first writer wins when two compute the same prefix)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self._cached[block_hash] = block_id

    def uncache(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = block.token_ids = None

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._cached.values()):
            self.uncache(block_id)

    def check_all_free(self) -> None:
        """The invariant tests check after all requests end: every block free exactly once, no references."""
        held = [b for b in self.blocks if b.ref_count != 0]
        if held:
            raise AssertionError(f"blocks still referenced: {held[:8]}")
        if len(self._free) != self.num_blocks or set(self._free) != set(range(self.num_blocks)):
            raise AssertionError(f"free list holds {len(self._free)} of {self.num_blocks} blocks")
