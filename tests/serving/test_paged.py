"""The paged cache's parts: the block allocator, prefix keys, the gathered per-layer view."""

from __future__ import annotations

import pytest
import torch

from dikkat.layers import KVCache
from dikkat.serving import BlockAllocator, PagedKVPool, prefix_hashes


def test_prefix_keys_name_the_whole_prefix():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # full blocks only
    assert prefix_hashes([1, 2, 3, 4, 9], 2) == a[:2]
    assert prefix_hashes([0, 2, 3, 4], 2)[1] != a[1]  # a change in block 0 changes block 1's key
    assert prefix_hashes([3, 4], 2)[0] != a[1]  # same block, other prefix
    assert prefix_hashes([1], 2) == []


def test_blocks_are_shared_by_count_and_kept_for_reuse_after_their_last_user():
    alloc = BlockAllocator(3)
    key = prefix_hashes([1, 2], 2)[0]
    b = alloc.allocate()
    alloc.register(b, key)
    assert alloc.lookup(key) == b
    alloc.share(b)
    alloc.release(b)
    assert alloc.free_count == 2  # still used once
    alloc.release(b)
    assert alloc.free_count == 3 and alloc.is_evictable(b) and alloc.lookup(key) == b
    alloc.share(b)  # found again: used, no longer free
    assert alloc.free_count == 2 and not alloc.is_evictable(b)
    alloc.release(b)
    with pytest.raises(ValueError, match="released more often"):
        alloc.release(b)


def test_allocation_evicts_the_least_recently_released_prefix_when_nothing_is_free():
    alloc = BlockAllocator(2)
    keys = prefix_hashes([1, 2, 3, 4], 2)
    blocks = [alloc.allocate(), alloc.allocate()]
    for block, key in zip(blocks, keys, strict=True):
        alloc.register(block, key)
    alloc.release(blocks[1])
    alloc.release(blocks[0])
    assert alloc.allocate() == blocks[1]  # released first
    assert alloc.lookup(keys[1]) is None and alloc.lookup(keys[0]) == blocks[0]
    alloc.allocate()
    with pytest.raises(RuntimeError, match="all 2 blocks are in use"):
        alloc.allocate()


def test_a_layer_view_reads_what_a_kv_cache_holds():
    """Two rows written token by token into scattered blocks: the gathered view equals each
    row's contiguous KVCache, right-aligned (fp64)."""
    G, D, P = 2, 3, 2
    pool = PagedKVPool(1, 8, P, G, D, dtype=torch.float64)
    tables = [[5, 1, 6], [2, 7]]  # row 0: 5 tokens, row 1: 3 tokens
    lengths = [5, 3]
    caches = [KVCache(1, G, 8, D, dtype=torch.float64) for _ in tables]
    g = torch.Generator().manual_seed(0)
    S = max(lengths)
    for step in range(S):
        # row b writes its token j = step − (S − lengths[b]) once it has started
        rows = [b for b in range(2) if step >= S - lengths[b]]
        for b in rows:
            j = step - (S - lengths[b])
            k, v = torch.randn(2, 1, G, 1, D, generator=g, dtype=torch.float64)
            caches[b].update(j, k, v)
            slot = torch.tensor([[tables[b][j // P] * P + j % P]])
            read = torch.tensor([[tables[b][i // P] * P + i % P for i in range(j + 1)]])
            got_k, got_v = pool.layers(slot, read)[0].update(j, k, v)
            assert torch.equal(got_k, caches[b].k[:, :, : j + 1])
            assert torch.equal(got_v, caches[b].v[:, :, : j + 1])


def test_a_layer_view_checks_what_it_is_given():
    pool = PagedKVPool(1, 4, 2, 1, 2)
    layer = pool.layers(torch.tensor([[3]]), torch.tensor([[0, 1, 3]]))[0]
    with pytest.raises(ValueError, match="start=1 \\+ T=1 must equal the 3 slots"):
        layer.update(1, torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    with pytest.raises(ValueError, match=r"\(B, G, T, D\) = \(1, 1, 1, 2\)"):
        layer.update(2, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
