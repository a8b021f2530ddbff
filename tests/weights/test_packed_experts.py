"""Experts stacked as a GGUF file stacks them (dikkat.weights.packed_layers.PackedExperts) and
their product (packed_linear_ids, the native ``qmm_ids``): each row times its own expert's
block of rows is bit for bit the product of that block alone, in every block format, NaN and
±Inf rows included; and the stacks multiply as the experts one by one do."""

from __future__ import annotations

import pytest
import torch
from test_gguf_blocks import random_blocks

import dikkat.weights.packed as packed_module
from dikkat.layers import GatedMLP
from dikkat.weights.formats import PACKED_KINDS, repack
from dikkat.weights.packed import dequantize, packed_linear, packed_linear_ids
from dikkat.weights.packed_layers import PackedExperts, PackedLinear

E, K = 5, 512  # K: whole super-blocks of 256 for the K-quants


def stack(kind: str, rows: int, seed: int, k: int = K):
    return repack(random_blocks(kind, E * rows, k, seed), kind, (E * rows, k)).in_groups()


def one_by_one(x: torch.Tensor, p, ids: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([packed_linear(x[m : m + 1], p.rows(e * rows, (e + 1) * rows))
                      for m, e in enumerate(ids.tolist())])  # fmt: skip


def rows_of(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, K, generator=torch.Generator().manual_seed(seed))
    x[2, 7] = float("inf")  # an infinite input: its terms added in fp32
    x[4, 9] = float("nan")
    return x


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_each_row_is_the_product_of_its_own_block_alone(kind):
    p = stack(kind, 32, seed=1)
    x = rows_of(7, seed=2)
    ids = torch.tensor([0, 3, 3, 3, 4, 1, 3])  # runs of one expert, and one expert between
    got = packed_linear_ids(x, p, ids, 32)
    want = one_by_one(x, p, ids, 32)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_without_the_native_kernel_the_same_product(monkeypatch):
    p = stack("Q4_K", 32, seed=3)
    x, ids = rows_of(6, seed=4), torch.tensor([4, 0, 0, 2, 2, 1])
    want = packed_linear_ids(x, p, ids, 32)
    monkeypatch.setattr(packed_module, "qmm_ids_op", lambda: None)
    got = packed_linear_ids(x, p, ids, 32)
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-5)


def test_bad_products_are_refused():
    p = stack("Q8_0", 32, seed=5)
    with pytest.raises(ValueError, match=r"x must be \(M, 512\) and ids \(M,\)"):
        packed_linear_ids(torch.randn(3, K), p, torch.tensor([0, 1]), 32)
    with pytest.raises(ValueError, match="rows=24 must be a multiple of 16"):
        packed_linear_ids(torch.randn(2, K), p, torch.tensor([0, 1]), 24)
    with pytest.raises(TypeError, match=r"ids must be int64 expert indices, got torch\.int32"):
        packed_linear_ids(torch.randn(2, K), p, torch.tensor([0, 1], dtype=torch.int32), 32)
    with pytest.raises(RuntimeError, match=r"ids must lie in \[0, 5\)"):
        packed_linear_ids(torch.randn(2, K), p, torch.tensor([0, 5]), 32)


@pytest.mark.parametrize("kinds", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_0", "Q8_0")])
def test_the_stacks_multiply_as_the_experts_one_by_one(kinds):
    """gate and up of one kind are joined (one product); of two kinds, multiplied apart."""
    H, C = 256, K  # (K-quants: widths of whole super-blocks)
    gate, up = stack(kinds[0], H, seed=6), stack(kinds[1], H, seed=7)
    down = repack(random_blocks(kinds[2], E * C, H, 8), kinds[2], (E * C, H))
    experts = PackedExperts(gate, up, down, E, torch.nn.SiLU())
    assert (experts.gate_up is not None) == (kinds[0] == kinds[1])
    x = torch.randn(6, C, generator=torch.Generator().manual_seed(9))
    ids = torch.tensor([0, 0, 2, 3, 3, 4])
    got = experts(x, ids)
    for m, e in enumerate(ids.tolist()):
        mlp = GatedMLP(C, H)
        views = experts.expert(e)
        if len(views) == 2:
            mlp.hold_gate_up(PackedLinear(views[0], None, False))
        else:
            mlp.gate, mlp.up = (PackedLinear(v, None, False) for v in views[:2])
        mlp.down = PackedLinear(views[-1], None, False)
        with torch.no_grad():
            assert torch.equal(got[m : m + 1], mlp(x[m : m + 1]))
            w = [dequantize(v) for v in (gate, up, down)]
            g, u, d = (t[e * t.shape[0] // E : (e + 1) * t.shape[0] // E] for t in w)
            exact = (torch.nn.functional.silu(x[m] @ g.T) * (x[m] @ u.T)) @ d.T
        torch.testing.assert_close(got[m], exact, atol=2e-3 * exact.abs().max(), rtol=0)


def test_stacks_that_do_not_fit_are_refused():
    gate = stack("Q8_0", 32, seed=10)
    down = repack(random_blocks("Q8_0", E * K, 32, 11), "Q8_0", (E * K, 32))
    with pytest.raises(ValueError, match="experts must stack as gate, up"):
        PackedExperts(gate, gate, down.rows(0, K), E, torch.nn.SiLU())


@pytest.mark.parametrize("act", [torch.nn.SiLU(), torch.nn.GELU(approximate="tanh")])
def test_the_native_mix_is_the_composite_one(monkeypatch, act):
    """``qmm_experts`` (one call: sort, both products, the weighted sum) gives bit for bit what
    the same steps in PyTorch operations give, and the trace holds it as one op."""
    import dikkat.weights.packed_layers as layers_module

    H, C = 256, K
    gate, up = stack("Q4_0", H, seed=12), stack("Q4_0", H, seed=13)
    down = repack(random_blocks("Q8_0", E * C, H, 14), "Q8_0", (E * C, H))
    experts = PackedExperts(gate, up, down, E, act)
    flat = torch.randn(4, C, generator=torch.Generator().manual_seed(15))
    picks = torch.tensor([[3, 0], [1, 3], [4, 2], [0, 1]])
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(16))
    native = experts.mix(flat, weights, picks)
    traced = torch.compile(experts.mix, backend="eager", fullgraph=True)(flat, weights, picks)
    monkeypatch.setattr(layers_module, "qmm_experts_op", lambda: None)
    assert torch.equal(native, experts.mix(flat, weights, picks))
    assert torch.equal(native, traced)


def test_an_activation_the_kernel_lacks_is_refused():
    gate = stack("Q8_0", 32, seed=17)
    down = repack(random_blocks("Q8_0", E * K, 32, 18), "Q8_0", (E * K, 32))
    with pytest.raises(ValueError, match="act must be SiLU or the tanh GELU"):
        PackedExperts(gate, gate, down, E, torch.nn.GELU())
