"""The native attention over a pool of slots (dikkat.kernels, ``paged_attention``): each
row's query at its own position, over its own slots, sliding windows and grouped heads, against
an fp64 reference."""

from __future__ import annotations

import pytest
import torch

from dikkat.kernels import paged_attention_op


def reference(q, k, v, slots, positions, window, scale):
    """fp64: every row's slots gathered, the columns past its position (or before its window)
    masked, softmax, the values."""
    H = q.shape[1]
    G, S = k.shape[1], slots.shape[1]
    keys = k.double()[slots].transpose(1, 2).repeat_interleave(H // G, dim=1)  # (B, H, S, D)
    values = v.double()[slots].transpose(1, 2).repeat_interleave(H // G, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), keys) * scale
    columns = torch.arange(S)
    kept = columns <= positions[:, None]
    if window:
        kept &= columns > positions[:, None] - window
    weights = torch.softmax(scores.masked_fill(~kept[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhs,bhsd->bhd", weights, values)


@pytest.fixture
def op():
    found = paged_attention_op()
    if found is None:  # the machines the suite runs on build it: tests/weights/test_packed.py
        pytest.skip("no native kernels here")
    return found


@pytest.mark.parametrize("H,G,D", [(4, 4, 16), (6, 2, 64), (3, 1, 40)])  # D not a multiple of 16
@pytest.mark.parametrize("window", [0, 1, 5])
def test_each_row_attends_its_own_slots(op, H, G, D, window):
    g = torch.Generator().manual_seed(H + D + window)
    N, B, S = 50, 3, 12
    k, v = torch.randn(N, G, D, generator=g), torch.randn(N, G, D, generator=g)
    q = torch.randn(B, H, D, generator=g) * 2
    slots = torch.randperm(N, generator=g)[: B * S].view(B, S)
    positions = torch.tensor([0, 7, 11])
    got = op(q, k, v, slots, positions, window, D**-0.5)
    want = reference(q, k, v, slots, positions, window, D**-0.5)
    assert got.shape == (B, H, D) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # what lies past each row's position (or outside the pool's slots it names) is not read
    slots[0, 1:] = 10**6
    assert torch.equal(op(q, k, v, slots, positions, window, D**-0.5)[0], got[0])


@pytest.mark.parametrize("window", [0, 3])
def test_pools_are_read_in_place_with_their_strides(op, window):
    """A static cache (1, G, S, D) transposed to a pool (S, G, D), and a pool whose head
    values are strided (copied first), give the contiguous pool's result."""
    g = torch.Generator().manual_seed(window)
    G, S, D = 2, 9, 24
    cache_k, cache_v = torch.randn(1, G, S, D, generator=g), torch.randn(1, G, S, D, generator=g)
    q = torch.randn(1, 4, D, generator=g)
    slots, positions = torch.arange(S).view(1, S), torch.tensor([6])
    pool_k, pool_v = cache_k[0].transpose(0, 1), cache_v[0].transpose(0, 1)
    assert not pool_k.is_contiguous()
    want = reference(q, pool_k, pool_v, slots, positions, window, D**-0.5)
    got = op(q, pool_k, pool_v, slots, positions, window, D**-0.5)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(
        got, op(q, pool_k.contiguous(), pool_v.contiguous(), slots, positions, window, D**-0.5)
    )
    wide = torch.randn(S, G, 2 * D, generator=g)
    every_other = wide[..., ::2]  # D values two floats apart
    assert torch.equal(
        op(q, every_other, pool_v, slots, positions, window, D**-0.5),
        op(q, every_other.contiguous(), pool_v, slots, positions, window, D**-0.5),
    )


def test_bad_inputs_are_refused(op):
    k = torch.zeros(8, 2, 16)
    q, slots = torch.zeros(1, 4, 16), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="positions must lie in 0"):
        op(q, k, k, slots, torch.tensor([3]), 0, 1.0)
    with pytest.raises(RuntimeError, match="slots must lie in 0"):
        op(q, k, k, torch.tensor([[0, 9, 0]]), torch.tensor([2]), 0, 1.0)
    with pytest.raises(RuntimeError, match="divide the query heads"):
        op(torch.zeros(1, 3, 16), k, k, slots, torch.tensor([0]), 0, 1.0)
    with pytest.raises(RuntimeError, match="window must be"):
        op(q, k, k, slots, torch.tensor([0]), -1, 1.0)
    with pytest.raises(RuntimeError, match="q must be"):
        op(q.double(), k, k, slots, torch.tensor([0]), 0, 1.0)
