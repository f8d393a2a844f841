"""BlockPool: the physical KV blocks, their ref counts, the prefix-cache index and an O(1) LRU free list.

A freed block keeps its hash and waits at the tail of the free list, so a later request with the same
prefix can revive it; allocation takes the head (least recently freed) and only then forgets its hash.
Blocks never handed out lead the free list in id order, and exist as objects only from their first allocation: a
pool of millions of blocks (a host swap pool for a small model, block size 1) costs nothing until it is used
(made up front, 4 GiB of host blocks for a test model at block size 1 took 4 s).
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
        self.blocks: list[Block] = []  # every block handed out so far, by id; ids from len(blocks) on never were
        self._free: OrderedDict[int, None] = OrderedDict()  # blocks released, least recently first
        self._cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - len(self.blocks)

    def allocate(self) -> int:
        """Take a block never used, else the least recently freed one, evicting its prefix-cache entry if it had
        one."""
        if len(self.blocks) < self.num_blocks:
            block = Block(len(self.blocks))
            self.blocks.append(block)
        else:
            block = self.blocks[self._free.popitem(last=False)[0]]
            self.uncache(block.block_id)
        block.ref_count = 1
        return block.block_id

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
        if len(self._free) != len(self.blocks) or set(self._free) != set(range(len(self.blocks))):
            raise AssertionError(f"free list holds {len(self._free)} of the {len(self.blocks)} blocks handed out")
