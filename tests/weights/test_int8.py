"""Weight formats for inference: int8 per-channel quantisation against fp64, the int8 product
against the dequantised product, and the linear layers of ``inference_model(model, weights)``.

Notation: ``N`` output features, ``K`` input features, ``M`` input rows.
"""

from __future__ import annotations

import pytest
import torch

from dikkat.layers import Linear, LinearRows
from dikkat.weights import (
    WEIGHT_FORMATS,
    dequantize_int8,
    inference_model,
    int8_linear,
    quantize_int8,
)

BF16_EPS = 2.0**-8  # unit roundoff of bf16 (8 significant bits)


def weight(N: int, K: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes: one scale per tensor would fail the per-row bound."""
    g = torch.Generator().manual_seed(seed)
    rows = 10.0 ** torch.linspace(-3, 2, N)
    return torch.randn(N, K, generator=g) * rows[:, None]


def test_int8_error_is_at_most_half_a_step_of_each_channel():
    w = weight(12, 40)
    q = quantize_int8(w)
    assert q.values.dtype == torch.int8 and q.values.shape == (12, 40) and q.scale.shape == (12,)
    assert int(q.values.abs().max()) == 127  # each row's largest entry takes the top code
    err = (dequantize_int8(q, torch.float64) - w.double()).abs()  # (N, K)
    step = q.scale.double()[:, None]
    assert bool((err <= step / 2 * (1 + 1e-6)).all())
    assert float((err / step).max()) > 0.25  # the bound is not met trivially
    # per channel: the small rows are as exact, relative to their size, as the large ones
    rel = err.amax(1) / w.double().abs().amax(1)
    assert float(rel.max()) <= 0.5 / 127 * (1 + 1e-6)


def test_a_row_of_zeros_gets_a_unit_scale_and_stays_zero():
    w = weight(3, 16)
    w[1] = 0.0
    q = quantize_int8(w)
    assert float(q.scale[1]) == 1.0 and not bool(q.values[1].any())
    assert not bool(dequantize_int8(q)[1].any())


def test_quantize_rejects_what_is_not_a_matrix():
    with pytest.raises(ValueError, match=r"weight must be a 2-D floating-point tensor.*\(4,\)"):
        quantize_int8(torch.ones(4))


@pytest.mark.parametrize(
    "K, shape",
    [(64, (1, 64)), (64, (3, 64)), (48, (2, 5, 48)), (20, (1, 20)), (20, (2, 3, 20))],
    ids=["kernel-1row", "kernel-3rows", "kernel-3d", "fallback-1row", "fallback-3d"],
)
def test_int8_product_equals_the_dequantised_product(K, shape):
    """K a multiple of 16 runs torch's kernel (x and the scales rounded to bf16, the result too),
    other K the dequantised weight in fp32; both against fp64 with the dequantised weight."""
    w, b = weight(24, K, seed=1), torch.randn(24)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    q = quantize_int8(w)
    out = int8_linear(x, q, b)
    assert out.shape == (*shape[:-1], 24) and out.dtype == x.dtype
    w64 = dequantize_int8(q, torch.float64)
    ref = x.double() @ w64.T + b.double()
    size = x.double().abs() @ w64.abs().T + b.double().abs()  # Σ|x||w|: what rounding scales
    rounding = 4 * BF16_EPS if K % 16 == 0 else 1e-5  # x, scale, output in bf16 / fp32 sums
    err = (out.double() - ref).abs()
    assert bool((err <= rounding * size + 1e-6).all())
    assert float(err.max()) > 0  # a real product, not the reference handed back


def test_int8_product_checks_the_width():
    q = quantize_int8(weight(4, 16))
    with pytest.raises(ValueError, match=r"16 input features, got \(1, 8\)"):
        int8_linear(torch.randn(1, 8), q)


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_a_copy_multiplies_in_its_format_and_the_linear_keeps_its_parameters(weights):
    torch.manual_seed(0)
    m = Linear(32, 24)
    x = torch.randn(2, 32)
    before = m.weight.detach().clone(), m.bias.detach().clone()
    with torch.no_grad():
        exact = m(x)
    copy = inference_model(m, weights)
    got = copy(x)
    assert copy.weights_format == weights
    if weights == "int8":
        expected = int8_linear(x, quantize_int8(m.weight), m.bias)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    else:
        w16, b16 = m.weight.bfloat16().double(), m.bias.bfloat16().double()
        ref = x.bfloat16().double() @ w16.T + b16
        size = x.double().abs() @ m.weight.double().abs().T + m.bias.double().abs()
        assert bool(((got.double() - ref).abs() <= 2 * BF16_EPS * size + 1e-6).all())
    assert float((got - exact).abs().max()) > 0  # the copy, not the fp32 weight, was used
    assert got.dtype == x.dtype
    assert torch.equal(m.weight, before[0]) and torch.equal(m.bias, before[1])
    # what the layers' input checks read: the model's dtype and device, not the format's
    assert (copy.weight.dtype, copy.weight.device, copy.weight.shape) == (
        torch.float32,
        x.device,
        (24, 32),
    )


@pytest.mark.parametrize(("start", "stop"), [(0, 8), (8, 20), (20, 24)])
def test_int8_rows_of_a_copy_are_the_rows_quantised_alone(start, stop):
    """Each output channel has its own scale, so a block of rows of the whole int8 weight is
    what quantising those rows alone gives: the same products, to the bit."""
    torch.manual_seed(1)
    m = Linear(32, 24)
    m.weight.data = weight(24, 32, seed=3)
    copy = inference_model(LinearRows(m, start, stop), "int8")
    x = torch.randn(3, 32)
    w, b = m.weight[start:stop].detach(), m.bias[start:stop].detach()
    assert torch.equal(copy(x), int8_linear(x, quantize_int8(w), b))


def test_a_bf16_copy_runs_in_the_model_s_dtype_around_its_bf16_product():
    torch.manual_seed(2)
    m = Linear(32, 24).double()
    x = torch.randn(5, 32, dtype=torch.float64)
    got = inference_model(m, "bf16", batched=True)(x)
    assert got.dtype == torch.float64
    w16, b16 = m.weight.bfloat16().double(), m.bias.bfloat16().double()
    ref = x.bfloat16().double() @ w16.T + b16
    size = x.abs() @ m.weight.abs().T + m.bias.abs()
    assert bool(((got - ref).abs() <= 2 * BF16_EPS * size + 1e-6).all())


@pytest.mark.parametrize("bad", ["int4", "FP32", "", 8])
def test_an_unknown_format_is_refused_by_name(bad):
    refused = r"weights must be one of 'fp32', 'bf16', 'int8', 'w8a8', 'q8', 'q4', got"
    with pytest.raises(ValueError, match=refused):
        inference_model(Linear(4, 4), bad)
    assert WEIGHT_FORMATS == ("fp32", "bf16", "int8", "w8a8", "q8", "q4")
