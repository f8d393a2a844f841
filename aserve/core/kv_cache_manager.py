"""KVCacheManager: maps requests' logical blocks to physical ones, with prefix caching and copy-on-write.

Prefix caching keys each full block by a chained sha256 (parent digest + its token ids); sharing among the
samples of one prompt (n > 1) reuses the first sample's blocks. A shared block is copied before it is
written: the copy is queued in `pending_copies` for the model runner to perform before the next forward.
It also owns the host swap pool: `swap_out` moves a request's blocks to host blocks and `swap_in` brings
them back, each returning the block pairs the runner copies.
"""
from __future__ import annotations

import hashlib
from array import array

from aserve.core.block_pool import BlockPool
from aserve.request import Request, RequestStatus


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)  # no prefix index: a host block belongs to one request
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block pairs, copy-on-write
        self.held_sources: list[int] = []  # freed copy sources kept from reuse until the copies are taken (free)
        self.fresh_blocks: list[int] = []  # allocated since the last take_fresh(), to be zeroed before use
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which were found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- looking up what is already computed ------------------------------------------------------

    def _block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        bs, hashes = self.block_size, req.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            root = req.lora.hash_root if req.lora is not None else b""  # an adapter's blocks are its own
            hashes.append(chain_hash(hashes[-1] if hashes else root, req.all_token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def find_computed(self, req: Request) -> tuple[list[int], int]:
        """Blocks a new or recomputing request can reuse, and how many of its tokens they hold.

        A sample of an n > 1 prompt takes its first sample's blocks; otherwise the prefix cache is asked.
        The last token is always left to compute, since its logits are needed.
        """
        parent = req.fork_parent
        if (parent is not None and parent.status == RequestStatus.RUNNING and not req.output_token_ids
                and parent.num_computed_tokens >= req.num_tokens - 1 and req.num_tokens > 1):
            num_tokens = req.num_tokens - 1
            return parent.block_table[:self.blocks_needed(num_tokens)], num_tokens
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None or req.pooling is not None:
            return [], 0  # prompt logprobs and pooling need every prompt position computed
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[int] = []
        for i, block_hash in enumerate(self._block_hashes(req, max_blocks)):
            block_id = self.pool.lookup(block_hash, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    # -- allocation -------------------------------------------------------------------------------

    def blocks_taken(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = (),
                     num_computed_tokens: int = 0) -> int:
        """How many free blocks `allocate_slots` would take: new ones, a copy-on-write, cached ones revived."""
        bs, pool, table = self.block_size, self.pool, req.block_table
        start = req.num_computed_tokens + num_computed_tokens
        num_held = len(table) + len(computed_blocks)
        num_new_blocks = max(0, self.blocks_needed(start + num_new_tokens) - num_held)
        first_write = start // bs  # the only block already held that this step can write into
        if first_write < len(table):  # decode and later chunks: no copy of the table on this per-step path
            write_shared = pool.ref_count(table[first_write]) > 1
        else:  # a block being taken over now is shared as soon as anyone else holds it
            write_shared = first_write < num_held and pool.ref_count(computed_blocks[first_write - len(table)]) > 0
        revived = sum(1 for b in computed_blocks if pool.ref_count(b) == 0)
        return num_new_blocks + write_shared + revived

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] = (), num_computed_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens of `req`; False (and no change) if blocks are short.

        `computed_blocks` (from find_computed) are taken over by a request that holds no blocks yet.
        """
        pool, table = self.pool, req.block_table
        if self.blocks_taken(req, num_new_tokens, computed_blocks, num_computed_tokens) > pool.num_free:
            return False
        start = req.num_computed_tokens + num_computed_tokens
        num_new_blocks = max(0, self.blocks_needed(start + num_new_tokens) - len(table) - len(computed_blocks))
        for block_id in computed_blocks:
            pool.acquire(block_id)
        table.extend(computed_blocks)
        req.num_computed_tokens += num_computed_tokens
        first_write = start // self.block_size
        if first_write < len(table):
            old = table[first_write]
            if pool.ref_count(old) > 1:  # copy-on-write
                new = pool.allocate()
                self.pending_copies.append((old, new))
                pool.release(old)
                table[first_write] = new
            else:  # about to be written: it no longer matches its hash
                pool.uncache(old)
        for _ in range(num_new_blocks):
            block_id = pool.allocate()
            table.append(block_id)
            self.fresh_blocks.append(block_id)
        return True

    def allocate_all(self, entries: list[tuple[Request, int, list[int], int]]) -> bool:
        """allocate_slots for several sequences that run together (a beam search's beams): all or none. The
        check adds up each one's need, which counts a block two of them share (a copy-on-write, a revived
        prefix) twice: it may refuse a step that would just fit, never admit one that does not."""
        if len(entries) == 1:
            return self.allocate_slots(*entries[0])
        if sum(self.blocks_taken(*entry) for entry in entries) > self.pool.num_free:
            return False
        # Every sequence's prefix-cache blocks first: a block one of them found cached sits in the free list, and
        # a new block handed to a sequence before it could be that very block (a recomputed beam search's second
        # beam then read its context from the first beam's next block, zeroed).
        for seq, _, blocks, num in entries:
            if blocks and not self.allocate_slots(seq, 0, blocks, num):
                raise RuntimeError(f"{seq} found no room it was promised")
        for seq, n, _, _ in entries:
            if not self.allocate_slots(seq, n):
                raise RuntimeError(f"{seq} found no room it was promised")
        return True

    def adopt(self, seqs: list[Request], parents: list[Request]) -> None:
        """Beam search's fork and drop in one move: seqs[i] goes on from parents[i]'s cache state (a sequence among
        `seqs`, itself included), sharing its blocks (a shared block is copied before it is written) and giving
        back its own. The new references are taken before the old ones are dropped, so a block that stays in use
        is never freed in between; a block no beam keeps returns to the pool now (its prefix hash kept)."""
        taken = [(list(p.block_table), p.num_computed_tokens, list(p.block_hashes), p.num_cached_blocks)
                 for p in parents]
        for table, *_ in taken:
            for block_id in table:
                self.pool.acquire(block_id)
        for seq in seqs:
            for block_id in reversed(seq.block_table):
                self.pool.release(block_id)
        for seq, (table, num_computed, hashes, num_cached) in zip(seqs, taken):
            seq.block_table, seq.num_computed_tokens = table, num_computed
            seq.block_hashes, seq.num_cached_blocks = hashes, num_cached

    def cache_full_blocks(self, req: Request) -> None:
        """Index the request's blocks that have just become full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_table))
        if num_full <= req.num_cached_blocks:
            return
        hashes = self._block_hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            self.pool.cache(req.block_table[i], hashes[i], tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
        req.num_cached_blocks = num_full

    def trim(self, req: Request) -> None:
        """Give back the blocks past those its tokens need (speculative decoding: blocks that held only rejected
        proposals; they were never cached, since they held no computed token of it)."""
        keep = self.blocks_needed(req.num_tokens)
        for block_id in reversed(req.block_table[keep:]):
            self.pool.release(block_id)
        del req.block_table[keep:]

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so the tail is evicted before the shared prefix.

        A block that another sequence's copy-on-write still has to read this step (a sample that took its parent's
        blocks, the parent then preempted) is kept from reuse until the copies are taken: handed out again in the
        same step, it would be zeroed as fresh before the worker copied it."""
        freed = set(req.block_table)
        if freed and self.pending_copies:
            self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in freed]
            for src in {s for s, _ in self.pending_copies} & freed:
                self.pool.acquire(src)
                self.held_sources.append(src)
        for block_id in reversed(req.block_table):
            self.pool.release(block_id)
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0

    # -- the host swap pool -----------------------------------------------------------------------

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free

    def can_swap_out(self, seqs: list[Request]) -> bool:
        num_blocks = len({b for seq in seqs for b in seq.block_table})
        return 0 < num_blocks <= self.host_pool.num_free

    def swap_out(self, seqs: list[Request]) -> list[tuple[int, int]]:
        """Give the sequences' device blocks back, their K/V to be kept in host blocks: (device, host) pairs. The
        sequences of one request (a beam search's beams) keep sharing what they shared: one host block each.

        A copy-on-write still pending for one of its blocks has not happened yet, so that block's
        content is read from the copy's source."""
        pending = {dst: src for src, dst in self.pending_copies}
        host_of: dict[int, int] = {}
        pairs = []
        for seq in seqs:
            host_table = []
            for block_id in seq.block_table:
                host_block = host_of.get(block_id)
                if host_block is None:
                    host_block = host_of[block_id] = self.host_pool.allocate()
                    pairs.append((pending.get(block_id, block_id), host_block))
                else:
                    self.host_pool.acquire(host_block)
                host_table.append(host_block)
            num_computed = seq.num_computed_tokens
            self.free(seq)  # releases device blocks (cached ones stay revivable) and drops pending copies
            seq.host_block_table = host_table
            seq.num_computed_tokens = num_computed
        return pairs

    def can_swap_in(self, plan: list[tuple[Request, int]]) -> bool:
        """Whether the sequences fit back with room for their next tokens (and a copy-on-write each, when they
        share blocks)."""
        host_blocks = {h for seq, _ in plan for h in seq.host_block_table}
        needed = len(host_blocks) + (len(plan) if len(plan) > 1 else 0)
        for seq, num_new in plan:
            needed += max(0, self.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.host_block_table))
        return needed <= self.pool.num_free

    def swap_in(self, seqs: list[Request]) -> list[tuple[int, int]]:
        """Bring swapped sequences' blocks back to the device, shared as they were: (host, device) pairs."""
        device_of: dict[int, int] = {}
        pairs = []
        for seq in seqs:
            table = []
            for host_block in seq.host_block_table:
                block_id = device_of.get(host_block)
                if block_id is None:
                    block_id = device_of[host_block] = self.pool.allocate()
                    pairs.append((host_block, block_id))
                else:
                    self.pool.acquire(block_id)
                table.append(block_id)
            self.free_host(seq)
            seq.block_table = table
        return pairs

    def free_host(self, req: Request) -> None:
        for host_block in req.host_block_table:
            self.host_pool.release(host_block)
        req.host_block_table = []

    def take_fresh(self) -> list[int]:
        """Blocks handed out since the last call. The runner zeroes them: the slots a request has not written
        yet are masked in attention, but a NaN left there by an earlier owner whose model output went bad
        would still poison the value product (0 * NaN is NaN), i.e. leak one request's fault into another."""
        fresh, self.fresh_blocks = self.fresh_blocks, []
        return fresh

    def take_copies(self) -> list[tuple[int, int]]:
        """The step's copies-on-write, for the worker; the freed sources they read are free again from the next
        step on (see free)."""
        copies, self.pending_copies = self.pending_copies, []
        for block_id in self.held_sources:
            self.pool.release(block_id)
        self.held_sources = []
        return copies

    def check_all_free(self) -> None:
        self.pool.check_all_free()
        self.host_pool.check_all_free()
