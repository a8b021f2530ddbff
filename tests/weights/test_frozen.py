"""A frozen packed layer's product that a gradient flows through (dikkat.weights.frozen): the
forward is the layer's own product exactly; the input's gradient is the output's gradient times
the dequantised weight, against fp64, in every packed GGUF format, across the blocks of rows
the backward dequantises and across a layer's parts of two formats; the layer gets no
gradient."""

from __future__ import annotations

import pytest
import torch
from test_gguf_blocks import random_blocks
from torch import nn

import dikkat.weights.frozen as frozen_module
from dikkat.weights.formats import PACKED_KINDS, repack
from dikkat.weights.frozen import frozen_linear
from dikkat.weights.packed import dequantize
from dikkat.weights.packed_layers import PackedLinear

K = 512  # whole super-blocks of 256 for the K-quants


def packed(kind: str, rows: int, seed: int):
    return repack(random_blocks(kind, rows, K, seed), kind, (rows, K))


def check(layer: PackedLinear, weight: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, K, generator=g, requires_grad=True)
    y = frozen_linear(x, layer)
    with torch.no_grad():
        torch.testing.assert_close(y, layer(x), rtol=0, atol=0)  # the layer's own product
    upstream = torch.randn(y.shape, generator=g)
    (y * upstream).sum().backward()
    expected = upstream.double() @ weight.double()
    # fp32 sums of N terms against fp64: to a few ulps of the largest value
    scale = float(expected.abs().max())
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-5, atol=1e-6 * scale)
    assert all(p.grad is None for p in layer.parameters())


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_the_input_gradient_is_the_dequantised_weight_s(kind, monkeypatch):
    monkeypatch.setattr(frozen_module, "ROWS_AT_ONCE", 48)  # blocks of rows, and a last part
    p = packed(kind, 80, seed=1)
    layer = PackedLinear(p, None, batched=False)
    check(layer, dequantize(p), seed=2)


def test_parts_of_two_formats_and_a_bias(monkeypatch):
    monkeypatch.setattr(frozen_module, "ROWS_AT_ONCE", 32)
    a, b = packed("Q4_K", 48, seed=3), packed("Q8_0", 32, seed=4)
    bias = nn.Parameter(torch.randn(80), requires_grad=False)
    layer = PackedLinear([a, b], bias, batched=True)
    check(layer, torch.cat([dequantize(a), dequantize(b)]), seed=5)


def test_a_plain_linear_and_what_is_refused():
    linear = nn.Linear(K, 16).requires_grad_(False)
    check(linear, linear.weight, seed=6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="requires grad: freeze it"):
        frozen_linear(torch.randn(1, K), nn.Linear(K, 4))
    with pytest.raises(TypeError, match=r"PackedLinear, HalfLinear or nn\.Linear, got Conv1d"):
        frozen_linear(torch.randn(1, K), nn.Conv1d(1, 1, 1))  # type: ignore[arg-type]


def test_an_input_of_the_wrong_width_is_named():
    layer = PackedLinear(packed("Q8_0", 32, seed=7), None, batched=False)
    with pytest.raises(
        ValueError, match=r"x must be floating-point \(\.\.\., 512\), got \(2, 64\)"
    ):
        frozen_linear(torch.randn(2, 64), layer)


def test_a_16_bit_table_and_the_bf16_backward(monkeypatch):
    """A 16-bit table (a GGUF file's F16) widened a block of rows at a time; under bf16
    autocast the backward's product runs in bf16, within bf16's rounding of its inputs."""
    from dikkat.weights.half import HalfLinear

    monkeypatch.setattr(frozen_module, "ROWS_AT_ONCE", 24)
    table = torch.randn(40, K).half()
    layer = HalfLinear(table, None)
    check(layer, table.float(), seed=7)  # type: ignore[arg-type]

    x = torch.randn(4, K, requires_grad=True)
    upstream = torch.randn(4, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = frozen_linear(x, layer)
    (y * upstream).sum().backward()
    expected = upstream.double() @ table.double()
    assert x.grad.dtype == torch.float32
    error = (x.grad.double() - expected).norm() / expected.norm()
    assert 1e-6 < error < 1e-2  # bf16's, not fp32's: the half product did run
