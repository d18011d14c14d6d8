"""Unit tests of the prefix caches: vLLM 16-token blocks, SGLang token pages, llama.cpp slots."""

from gateway.sim.prefix import BlockCache, SlotCache, common_prefix


def test_block_cache_counts_only_full_blocks():
    cache = BlockCache(16, 10_000)
    prompt = list(range(50))
    assert cache.match(prompt) == 0
    cache.insert(prompt)
    assert cache.match(prompt) == 48  # 3 full blocks; the tail is recomputed
    assert cache.match(list(range(40)) + [999] * 10) == 32
    assert cache.match([7] + list(range(1, 50))) == 0  # chained: a changed first block misses all


def test_block_cache_never_covers_the_whole_prompt():
    cache = BlockCache(16, 10_000)
    prompt = list(range(32))
    cache.insert(prompt)
    assert cache.match(prompt) == 16  # the last token must be computed


def test_token_granular_cache_matches_longest_prefix():
    cache = BlockCache(1, 10_000)
    cache.insert([1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 9, 9])
    assert cache.match([1, 2, 3, 4, 7, 7]) == 4
    assert cache.match([1, 2, 9, 9, 9]) == 4
    assert cache.match([1, 2, 3]) == 2


def test_block_cache_evicts_least_recently_used():
    cache = BlockCache(1, 6)
    cache.insert([1, 2, 3])
    cache.insert([4, 5, 6])
    cache.match([1, 2, 3, 0])  # touch the first prompt
    cache.insert([7, 8, 9])
    assert cache.match([1, 2, 3, 0]) == 3
    assert cache.match([4, 5, 6, 0]) == 0


def test_common_prefix():
    assert common_prefix(list(range(200)), list(range(150)) + [0]) == 150
    assert common_prefix([], [1]) == 0


def test_slot_cache_prefers_similar_slot_else_least_recently_used():
    slots = SlotCache(3, similarity=0.1)
    slots.store(0, [1, 2, 3, 4, 5, 6, 7, 8])
    slots.store(1, [9, 9, 9])
    slot, reuse = slots.choose([1, 2, 3, 4, 0, 0], idle=[0, 1, 2])
    assert (slot, reuse) == (0, 4)
    slot, reuse = slots.choose([5, 5, 5], idle=[0, 1, 2])
    assert (slot, reuse) == (2, 0)  # never used: least recently used
    slot, reuse = slots.choose([1, 2, 3, 4, 0, 0], idle=[1, 2])
    assert reuse == 0  # the warm slot is busy: no reuse elsewhere


def test_slot_reuse_keeps_one_token_to_compute():
    slots = SlotCache(1)
    slots.store(0, [1, 2, 3])
    assert slots.choose([1, 2, 3], idle=[0]) == (0, 2)
