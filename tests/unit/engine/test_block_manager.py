"""BlockManager: allocation, ref counts, prefix sharing and eviction, without tensors."""

from __future__ import annotations

from keepwarm_runtime.engine.block_manager import BlockManager
from keepwarm_runtime.engine.sampling_params import SamplingParams
from keepwarm_runtime.engine.sequence import Sequence


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, 0, tokens, SamplingParams())


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    s.num_computed_tokens = n
    bm.cache_full_blocks(s)


def test_allocate_rounds_up_to_blocks_and_free_returns_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    assert bm.allocate(s, 10)
    assert len(s.block_ids) == 3 and bm.num_free_blocks == 5
    assert bm.allocate(s, 12)  # still fits the third block
    assert len(s.block_ids) == 3
    assert bm.allocate(s, 13)
    assert len(s.block_ids) == 4
    bm.free(s)
    assert s.block_ids == [] and bm.num_free_blocks == 8 and bm.usage() == 0.0


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = seq(list(range(8)), "a"), seq(list(range(100, 108)), "b")
    assert bm.allocate(a, 8)
    assert not bm.allocate(b, 8)
    assert b.block_ids == [] and bm.num_free_blocks == 1


def test_shared_prefix_reuses_computed_blocks_with_ref_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    assert bm.allocate(a, a.num_tokens)
    assert bm.find_cached_prefix(a) == []  # nothing computed yet: no hits on unwritten K/V
    computed(bm, a, a.num_tokens)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], "b")
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate(b, b.num_tokens, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [bm.blocks[i].ref_count for i in a.block_ids] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [1, 1, 1]


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)), "a")
    bm.allocate(a, 8)
    computed(bm, a, 8)
    assert len(bm.find_cached_prefix(seq(list(range(8)), "b"))) == 1


def test_freed_cached_blocks_are_revived_until_evicted() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a, 5)
    computed(bm, a, 5)
    first_two = a.block_ids[:2]
    bm.free(a)
    b = seq([1, 2, 3, 4, 9], "b")
    hits = bm.find_cached_prefix(b)
    assert hits == first_two
    assert bm.allocate(b, 5, hits) and bm.num_free_blocks == 0
    bm.free(b)
    c = seq([7, 7, 7, 7, 7, 7], "c")  # needs all three blocks: every cached hash is evicted
    assert bm.allocate(c, 6)
    assert bm.cached == {}
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5], "d")) == []


def test_prefix_caching_can_be_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(list(range(9)), "a")
    bm.allocate(a, 9)
    computed(bm, a, 9)
    assert bm.find_cached_prefix(seq(list(range(9)), "b")) == []
