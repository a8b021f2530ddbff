"""Packed 4-, 6- and 8-bit block weights (dikkat.weights.packed): dikkat's own Q8_0/Q4_0
quantisation, and the product — the dequantised weight times the activations rounded to int16
per block of 32 — against an fp64 reference, in the native kernel and in PyTorch operations."""

from __future__ import annotations

import pytest
import torch

from dikkat.kernels import qmm_op
from dikkat.layers import Linear
from dikkat.weights import inference_model
from dikkat.weights.bits import pack
from dikkat.weights.block_quantize import quantize_q4, quantize_q8
from dikkat.weights.packed import (
    DENSE_ROWS,
    PackedWeight,
    _product,
    dequantize,
    packed_linear,
    round_activations,
    stacked,
    unpack,
)
from dikkat.weights.packed_layers import PackedLinear

F32 = torch.float32


def reference(x: torch.Tensor, p: PackedWeight) -> torch.Tensor:
    """fp64: the dequantised weight times x rounded as the product rounds it."""
    a, d = round_activations(x)
    M, K = x.shape
    rounded = (a.double().view(M, K // 32, 32) * d.double()[..., None]).view(M, K)
    return rounded @ dequantize(p).double().T


def random_packed(
    N: int, K: int, bits: int, block: int, offsets: bool, seed: int, dtype: torch.dtype = F32
) -> PackedWeight:
    """A packed weight of random integers, scales (some negative) and offsets, in ``dtype``;
    int8: in two levels, times fp16 super-block values (K a multiple of 256)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    zero = 0 if offsets else 2 ** (bits - 1)
    if dtype == torch.int8:
        scale, offset = (torch.randint(-128, 128, (N, K // block), generator=g, dtype=dtype)
                         for _ in range(2))  # fmt: skip
        units = [(torch.randn(N, K // 256, generator=g) * 1e-3).half() for _ in range(2)]
        return PackedWeight(
            pack(q, bits), scale, offset if offsets else None, zero, bits, block, "test", False,
            units[0], units[1] if offsets else None,
        )  # fmt: skip
    scale = (torch.randn(N, K // block, generator=g) * 0.01).to(dtype)
    offset = (torch.randn(N, K // block, generator=g) * 0.05).to(dtype) if offsets else None
    values = pack(q, bits)
    return PackedWeight(values, scale, offset, zero, bits, block, "test")


# bits, block, offsets, the scales' dtype
LAYOUTS = [(bits, block, offsets, dtype) for bits in (4, 6, 8) for block in (16, 32) for offsets in
           (False, True) for dtype in (torch.float32, torch.float16)]  # fmt: skip


@pytest.mark.parametrize("bits,block,offsets,dtype", LAYOUTS)
@pytest.mark.parametrize("K", [32, 64, 96, 640])  # a lone last block of 32 where K % 64 = 32
@pytest.mark.parametrize("M", [1, 3, 8, 11])  # tiles of eight rows and what is left
def test_the_product_is_the_dequantised_weight_times_the_rounded_rows(
    bits, block, offsets, dtype, K, M
):
    # 37 rows: two groups of 16 of the kernel's layout, and 5 rows after them
    p = random_packed(37, K, bits, block, offsets, seed=K + M, dtype=dtype)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    want = reference(x, p)
    tol = 1e-5 * want.abs().max().item() + 1e-6  # fp32 sums of K products
    for got in (packed_linear(x, p), _product(x, p)):
        assert got.dtype == torch.float32 and got.shape == (M, 37)
        assert (got.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("bits,block,offsets", [(b, k, o) for b, k, o, d in LAYOUTS if d == F32])
@pytest.mark.parametrize("K", [256, 768])
@pytest.mark.parametrize("M", [1, 3, 8, 11])
def test_two_level_scales_multiply_as_their_products(bits, block, offsets, K, M):
    """An int8 scale (and offset) a block times an fp16 a super-block of 256, as K-quants hold
    them: the product is the weight with their fp32 products as its scales."""
    p = random_packed(37, K, bits, block, offsets, seed=K + M, dtype=torch.int8)
    scale, offset = p.block_scales()
    assert scale.dtype == torch.float32 and scale.shape == p.scale.shape
    one_level = PackedWeight(p.values, scale, offset, p.zero, bits, block, "one level")
    assert torch.equal(dequantize(p), dequantize(one_level))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    want = reference(x, one_level)
    tol = 1e-5 * want.abs().max().item() + 1e-6
    for got in (packed_linear(x, p), _product(x, p), packed_linear(x, p.in_groups())):
        assert (got.double() - want).abs().max().item() <= tol


def test_the_native_kernel_is_built_here():
    """The machines the suite runs on have a C++ compiler: the kernel must build (the PyTorch
    product is the fallback elsewhere, and is tested above either way)."""
    assert qmm_op() is not None


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_compiled_products_and_lookups_are_the_eager_ones(dtype, grouped):
    """torch.compile plans its buffers from the ops' fake implementations: the dequantised
    weight is fp32 whatever its scales are (an fp16 output there reads fp32 bytes as fp16)."""
    K = 256
    p = random_packed(40, K, 8, 32, dtype == torch.int8, seed=5, dtype=dtype)
    p = p.in_groups() if grouped else p
    ids, x = torch.tensor([[3, 17], [0, 39]]), torch.randn(2, K)

    def step(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = dequantize(p.take(ids.reshape(-1))).view(*ids.shape, K)  # an embedding lookup
        return packed_linear(rows + x[:, None], p)

    want = step(ids, x)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(ids, x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("N", [5, 16, 37])  # a tail alone, a group alone, both
@pytest.mark.parametrize(
    "bits,offsets,dtype", [(4, True, F32), (8, False, F32), (6, True, torch.int8)]
)
def test_the_kernel_s_groups_hold_the_same_weight(N, bits, offsets, dtype):
    K = 256
    p = random_packed(N, K, bits, 32, offsets, seed=N, dtype=dtype)
    g = p.in_groups()
    assert g.grouped and g.in_groups() is g and g.shape == p.shape and g.nbytes == p.nbytes
    back = g.in_rows()
    for name in ("values", "scale", "offset", "super_scale", "super_offset"):
        a, b = getattr(back, name), getattr(p, name)
        assert (a is None and b is None) or torch.equal(a, b)
    if N >= 16:  # 16 rows interleaved two bytes at a time: row 1's first pair follows row 0's
        assert torch.equal(g.values[0, 2:4], p.values[1, 0:2])
    index = torch.tensor([N - 1, 0, N // 2, N - 1])  # the tail, the groups, repeats
    with pytest.raises(ValueError, match="index must lie in"):
        g.take(torch.tensor([0, N]))  # past the last row: refused, not clamped
    rows = g.take(index)
    assert not rows.grouped and torch.equal(dequantize(rows), dequantize(p)[index])
    for start, stop in ((0, N), (1, N), (0, min(N, 16)), (N // 3, N - 1)):
        part = g.rows(start, stop)
        assert part.grouped and torch.equal(dequantize(part), dequantize(p)[start:stop])
    x = torch.randn(3, K)
    assert torch.equal(packed_linear(x, g), packed_linear(x, p))


def test_rows_are_independent_and_leading_dims_kept():
    p = quantize_q8(torch.randn(24, 64))
    x = torch.randn(2, 5, 64)
    whole = packed_linear(x, p)
    assert whole.shape == (2, 5, 24)
    alone = torch.stack([packed_linear(x[i, j : j + 1], p)[0] for i in range(2) for j in range(5)])
    assert torch.equal(whole.view(10, 24), alone)  # each row rounded on its own
    assert packed_linear(torch.zeros(0, 64), p).shape == (0, 24)


def test_zeros_round_to_zero():
    p = quantize_q4(torch.randn(8, 64))
    assert torch.equal(packed_linear(torch.zeros(3, 64), p), torch.zeros(3, 8))


@pytest.mark.parametrize("quantize,bound", [(quantize_q8, 0.5), (quantize_q4, 1.0)])
def test_quantizers_round_each_value_within_its_block_step(quantize, bound):
    w = torch.randn(16, 128) * torch.logspace(-3, 1, 16)[:, None]  # rows of many magnitudes
    w[3, :32] = 0  # a block of zeros
    p = quantize(w)
    step = p.scale.abs().repeat_interleave(32, dim=1)  # d of each value's block
    error = (dequantize(p) - w).abs()
    assert torch.all(error <= bound * step + 1e-12)
    assert torch.equal(dequantize(p)[3, :32], torch.zeros(32))
    # each block's largest value is kept to its rounding: Q8_0 to ±127 d, Q4_0 to −8 d
    assert p.nbytes < w.numel() * 4 / (3 if p.bits == 8 else 6)


def test_q4_packs_two_values_a_byte_and_unpacks_them():
    q = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    packed = pack(q, 4)
    assert packed.shape == (5, 48)
    p = PackedWeight(packed, torch.ones(5, 3), None, 8, 4, 32, "test")
    assert torch.equal(unpack(p), q)
    assert torch.equal(packed[:, 0] & 0x0F, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 16])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize_q8(torch.randn(4, 40))
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_q4(torch.ones(4, 32, dtype=torch.long))
    p = quantize_q8(torch.randn(4, 64))
    with pytest.raises(ValueError, match="64 input features"):
        packed_linear(torch.randn(2, 32), p)
    with pytest.raises(ValueError, match="scale must be"):
        PackedWeight(p.values, p.scale[:, :1], None, 128, 8, 32, "x")
    with pytest.raises(ValueError, match=r"bits must be one of \(4, 6, 8\)"):
        PackedWeight(p.values, p.scale, None, 128, 5, 32, "x")
    with pytest.raises(ValueError, match=r"values must be \(N, K·bits/8\)"):
        PackedWeight(p.values, p.scale, None, 128, 6, 32, "x")  # 8-bit bytes read as 6-bit
    for x in (torch.randn(2, 40), torch.randn(64), torch.ones(1, 32, dtype=torch.long)):
        with pytest.raises(ValueError, match="x must be floating-point rows"):
            round_activations(x)
    with pytest.raises(ValueError, match="fp32, fp16 or int8"):
        PackedWeight(p.values, p.scale.double(), None, 128, 8, 32, "x")
    small = p.scale.to(torch.int8)
    with pytest.raises(ValueError, match=r"int8 scale .* needs super_scale"):
        PackedWeight(p.values, small, None, 128, 8, 32, "x")  # no super-block values
    with pytest.raises(ValueError, match="needs super_scale"):
        PackedWeight(p.values, p.scale, None, 128, 8, 32, "x", False, torch.ones(4, 1).half())
    with pytest.raises(ValueError, match=r"must be \(N, K / 256\)"):
        PackedWeight(p.values, small, None, 128, 8, 32, "x", False, torch.ones(4, 1).half())
    with pytest.raises(ValueError, match="shaped and typed as scale"):
        PackedWeight(p.values, p.scale, p.scale.half(), 0, 8, 32, "x")


def test_a_layer_of_parts_in_two_layouts_multiplies_each_part():
    """A fused q/k/v projection whose parts a file quantised differently (Q5_0 beside Q8_0 ...)."""
    parts = [random_packed(8, 64, 8, 32, False, 1), random_packed(4, 64, 4, 32, True, 2),
             random_packed(4, 64, 4, 32, True, 3)]  # fmt: skip
    bias = torch.nn.Parameter(torch.randn(16), requires_grad=False)
    layer = PackedLinear(parts, bias, False)
    assert len(layer.parts) == 2  # the two 4-bit parts joined into one
    x = torch.randn(3, 64)
    want = torch.cat([reference(x, p) for p in parts], dim=1) + bias.double()
    assert (layer(x).double() - want).abs().max() <= 1e-4
    assert torch.allclose(layer.forward_rows(x, 6, 14), layer(x)[:, 6:14], atol=1e-6)
    assert layer.weight.shape == (16, 64) and layer.weight.dtype == torch.float32
    assert layer.nbytes == sum(p.nbytes for p in parts) + 16 * 4


@pytest.mark.parametrize("sizes", [(32, 16, 5), (16, 37)])
def test_parts_in_groups_stack_as_they_are_where_their_groups_line_up(sizes):
    """A loader hands q/k/v (or a large tensor's slices) already in groups of 16 rows: parts
    whose groups line up stack in groups, with no copy in rows, into the weight of all rows."""
    whole = random_packed(sum(sizes), 64, 4, 32, True, 4, dtype=torch.float16)
    ends = torch.tensor(sizes).cumsum(0).tolist()
    parts = [whole.rows(a, b).in_groups() for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    together = stacked(iter(parts), whole.shape[0])
    assert together.grouped
    for held, want in zip(together.tensors(), whole.in_groups().tensors(), strict=True):
        assert torch.equal(held, want)
    layer = PackedLinear(parts, None, False)
    assert len(layer.parts) == 1 and layer.parts[0].grouped
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), PackedLinear(whole, None, False)(x))
    with pytest.raises(ValueError, match="whole groups but the last"):
        stacked(reversed(parts), whole.shape[0])
    with pytest.raises(ValueError, match="the parts hold"):
        stacked(iter(parts[:-1]), whole.shape[0])
    with pytest.raises(ValueError, match="more than rows=16"):
        stacked(iter(parts), 16)
    other = random_packed(sizes[-1], 64, 8, 32, False, 5).in_groups()  # 8 bits, no offsets
    with pytest.raises(ValueError, match="one layout"):
        stacked(iter([*parts[:-1], other]), whole.shape[0])


@pytest.mark.parametrize("weights", ["q8", "q4"])
def test_any_dikkat_model_gets_the_packed_formats(weights):
    from dikkat.models import Decoder, DecoderConfig

    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=64, d_model=64, n_heads=2, d_ff=96, n_layers=2))
    copy = inference_model(model, weights)
    layers = [m for m in copy.modules() if isinstance(m, PackedLinear)]
    assert layers and {m.weights_format for m in layers} == {weights}
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want, got = model(ids), copy(ids)
    assert (got - want).abs().max() < (0.05 if weights == "q8" else 0.3) * want.abs().max()
    with pytest.raises(ValueError, match="whole blocks of 32"):
        inference_model(Linear(40, 8), weights)


@pytest.mark.parametrize("bits,block,offsets,dtype", LAYOUTS)
def test_a_prefill_is_rounded_as_a_decode_step_is_and_without_the_kernel_it_is_not(
    bits, block, offsets, dtype, monkeypatch
):
    """With the native kernel, any number of rows is the rounded product (a row's result never
    depends on its batch); without it, from DENSE_ROWS rows on x is not rounded: x times the
    dequantised weight, in fp32."""
    import dikkat.weights.packed as packed

    p = random_packed(300, 96, bits, block, offsets, seed=7, dtype=dtype)
    x = torch.randn(DENSE_ROWS + 3, 96)
    want = x.double() @ dequantize(p).double().T
    tol = 1e-5 * want.abs().max()
    if qmm_op() is not None:
        got = packed_linear(x, p)
        assert (got.double() - reference(x, p)).abs().max() <= tol
        assert torch.equal(got[:5], packed_linear(x[:5], p))  # the same rows, alone
    monkeypatch.setattr(packed, "_NATIVE", [None])
    assert (packed_linear(x, p).double() - want).abs().max() <= tol
    few = packed_linear(x[: DENSE_ROWS - 1], p)  # one short of the threshold: rounded
    assert (few.double() - reference(x[: DENSE_ROWS - 1], p)).abs().max() <= tol


def test_the_native_dequantisation_is_pytorch_s_bit_for_bit():
    from dikkat.weights.packed import _dequantize

    for bits, block, offsets, dtype in LAYOUTS:
        p = random_packed(9, 128, bits, block, offsets, seed=bits + block, dtype=dtype)
        assert torch.equal(dequantize(p), _dequantize(p))
