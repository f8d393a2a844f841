"""BlockPool and KVCacheManager without a model: LRU eviction, prefix revival, copy-on-write."""
from aserve.core.block_pool import BlockPool
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.request import Request, RequestStatus
from aserve.sampling_params import SamplingParams


def make(tokens, rid="r"):
    return Request(rid, tokens, SamplingParams())


def test_lru_free_list_evicts_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.cache(a, b"ha", (1,))
    pool.cache(b, b"hb", (2,))
    pool.release(b)
    pool.release(a)
    pool.release(c)
    assert pool.lookup(b"ha", (1,)) == a and pool.lookup(b"hb", (2,)) == b
    assert pool.lookup(b"ha", (9,)) is None  # the collision guard compares token ids
    assert pool.allocate() == b  # freed first, evicted first: its hash is forgotten
    assert pool.lookup(b"hb", (2,)) is None and pool.lookup(b"ha", (1,)) == a
    pool.acquire(a)  # revive a cached free block
    assert pool.num_free == 1 and pool.ref_count(a) == 1


def test_blocks_never_used_come_first_and_cost_nothing_until_then():
    """A pool of a billion blocks is made at once (blocks exist from their first allocation); never-used blocks go
    out in id order before any freed one, as if they led the free list; the all-free check counts what was used."""
    pool = BlockPool(10**9)
    assert pool.num_free == 10**9
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1) and pool.num_free == 10**9 - 2
    pool.release(a)
    assert pool.allocate() == 2 and pool.num_free == 10**9 - 2  # a fresh block before the freed one
    small = BlockPool(2)
    x, y = small.allocate(), small.allocate()
    small.release(y)
    small.release(x)
    assert small.allocate() == y and small.num_free == 1  # then the least recently freed
    small.release(y)
    small.check_all_free()
    pool.release(b)
    pool.release(2)
    pool.check_all_free()


def test_prefix_hits_share_blocks_and_last_token_is_recomputed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make(list(range(1, 13)), "a")  # 3 full blocks
    assert kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    second = make(list(range(1, 13)) + [99], "b")
    hits, num = kv.find_computed(second)
    assert hits == first.block_table and num == 12
    same = make(list(range(1, 13)), "c")
    hits, num = kv.find_computed(same)
    assert num == 8  # at least the last prompt token is always computed
    assert kv.allocate_slots(second, 1, *kv.find_computed(second))
    assert second.block_table[:3] == first.block_table and second.num_computed_tokens == 12
    assert all(kv.pool.ref_count(b) == 2 for b in first.block_table)
    kv.free(first)
    kv.free(second)
    kv.check_all_free()


def test_sequences_that_run_together_take_their_prefix_hits_before_any_new_block():
    """Two beams recomputed after a preemption each find their own first block cached, both in the free list, the
    second beam's least recently freed. Allocated one after the other, the first beam's new block was the second
    beam's hit: both then held it, the first wrote its next token there and the second read its context from it
    (found by a randomized engine run: a recomputed beam search found other, better-scoring beams than alone)."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    one, two = make([1, 2, 3, 4, 5], "one"), make([1, 2, 3, 9, 5], "two")  # a full block each, then a token
    for seq in (two, one):  # computed and cached; then freed, two's block first (least recently freed)
        assert kv.allocate_slots(seq, 4)
        seq.num_computed_tokens = 4
        kv.cache_full_blocks(seq)
    cached = {seq: list(seq.block_table) for seq in (one, two)}
    filler = make([7] * 8, "filler")
    assert kv.allocate_slots(filler, 8)  # the pool's two other blocks
    for seq in (two, filler, one):
        kv.free(seq)
    found = [kv.find_computed(seq) for seq in (one, two)]
    assert [blocks for blocks, _ in found] == [cached[one], cached[two]]
    assert kv.allocate_all([(seq, 1, blocks, num) for seq, (blocks, num) in zip((one, two), found)])
    assert one.block_table[0] == cached[one][0] and two.block_table[0] == cached[two][0]
    held = one.block_table + two.block_table
    assert len(set(held)) == 4 and all(kv.pool.ref_count(b) == 1 for b in held)
    kv.free(one)
    kv.free(two)
    kv.check_all_free()


def test_a_freed_copy_source_is_not_handed_out_before_the_copy():
    """A sample takes its parent's blocks and copies the shared partial one before writing its last prompt token;
    the parent is preempted in the same step (a policy displacing it for a request queued after the sample). The
    partial block, free again, was the next block handed out: the worker zeroes a step's fresh blocks before it
    copies, so the sample got zeros."""
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    parent = make([1, 2, 3, 4, 5, 6], "p")
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv.take_fresh()
    child = make([1, 2, 3, 4, 5, 6], "c")
    assert kv.allocate_slots(child, 1, parent.block_table[:2], 5)
    (source, _), = kv.pending_copies
    kv.free(parent)
    other = make([9, 9, 9, 9], "o")
    assert not kv.allocate_slots(other, 4)  # the only block not in use is the copy's source, still to be read
    assert kv.take_copies() == [(source, child.block_table[1])]
    assert kv.allocate_slots(other, 4) and other.block_table == [source]  # the next step may have it
    kv.free(child)
    kv.free(other)
    kv.check_all_free()


def test_copy_on_write_of_a_shared_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make([1, 2, 3, 4, 5, 6], "p")
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    parent.status = RequestStatus.RUNNING
    child = make([1, 2, 3, 4, 5, 6], "c")
    child.fork_parent = parent
    blocks, num = kv.find_computed(child)
    assert blocks == parent.block_table and num == 5
    assert kv.allocate_slots(child, 1, blocks, num)
    assert child.block_table[0] == parent.block_table[0]  # the full block is shared
    assert child.block_table[1] != parent.block_table[1]  # the partial one was copied before the write
    assert kv.take_copies() == [(parent.block_table[1], child.block_table[1])]
    assert kv.pool.ref_count(parent.block_table[0]) == 2 and kv.pool.ref_count(parent.block_table[1]) == 1
    kv.free(child)
    kv.free(parent)
    kv.check_all_free()


def test_allocation_fails_cleanly_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make(list(range(1, 10)))
    assert not kv.allocate_slots(r, 9)
    assert r.block_table == [] and kv.num_free_blocks == 2
    assert kv.allocate_slots(r, 8)
    assert kv.num_free_blocks == 0
