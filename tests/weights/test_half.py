"""A file's fp16 and bf16 matrices kept in 16 bits (dikkat.weights.half): the layer's product is
the fp64 product of the widened weight (with the native kernel and without), a block of its
rows is those rows' product, the embedding looks up widened rows, and bad tables are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dikkat.weights import HalfEmbedding, HalfLinear

DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


def close(got: torch.Tensor, want: torch.Tensor, K: int) -> None:
    """``got`` (fp32) is ``want`` (fp64) up to the rounding of K fp32 products and their sum."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got.double() - want).abs().max() <= 4e-7 * (K + 4) * (want.abs().max() + 1)


def layer(dtype: torch.dtype, N: int = 48, K: int = 80, seed: int = 0) -> HalfLinear:
    g = torch.Generator().manual_seed(seed)
    bias = torch.nn.Parameter(torch.randn(N, generator=g), requires_grad=False)
    return HalfLinear(torch.randn(N, K, generator=g).to(dtype), bias)


@DTYPES
@pytest.mark.parametrize("native", [True, False], ids=["kernel", "pytorch"])
@pytest.mark.parametrize("shape", [(80,), (1, 1, 80), (3, 80), (2, 20, 80)])
def test_the_product_is_the_widened_weight_s(dtype, native, shape):
    lin = layer(dtype)
    lin._native = native and lin._native  # without the kernel: PyTorch widens slices
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    want = F.linear(x.double(), lin.table.double(), lin.bias.double())
    close(lin(x), want, 80)
    close(lin.forward_rows(x, 8, 40), want[..., 8:40], 80)


@DTYPES
@pytest.mark.parametrize("native", [True, False], ids=["kernel", "pytorch"])
def test_a_weight_held_in_parts_is_the_stacked_weight(dtype, native):
    """q, k and v (or gate and up) held apart, each where it lies: the product of the stacked
    rows, and any block of rows, across the parts' edges too."""
    g = torch.Generator().manual_seed(2)
    tables = [torch.randn(n, 80, generator=g).to(dtype) for n in (32, 8, 8)]
    bias = torch.nn.Parameter(torch.randn(48, generator=g), requires_grad=False)
    lin = HalfLinear(tables, bias)
    lin._native = native and lin._native
    assert all(a is b for a, b in zip(lin.parts, tables, strict=True))  # not copied
    for shape in [(3, 80), (2, 6, 80)]:  # a decode's few rows; a prompt's, widened slices
        x = torch.randn(shape, generator=g)
        want = F.linear(x.double(), torch.cat(tables).double(), bias.double())
        close(lin(x), want, 80)
        for start, stop in [(0, 32), (30, 42), (33, 35), (40, 48)]:
            close(lin.forward_rows(x, start, stop), want[..., start:stop], 80)
    assert lin.nbytes == 48 * 80 * 2 + 48 * 4
    with pytest.raises(ValueError, match="held in 3 parts"):
        _ = lin.table
    with pytest.raises(ValueError, match="share one dtype and their columns"):
        HalfLinear([tables[0], tables[1][:, :40]], None)
    with pytest.raises(ValueError, match="at least one table"):
        HalfLinear([], None)


def test_the_pytorch_product_widens_in_slices(monkeypatch):
    """Without the kernel, a weight larger than a slice is widened a slice at a time."""
    monkeypatch.setattr("dikkat.weights.half._SLICE_BYTES", 16 * 4 * 80)  # 16 rows a slice
    lin = layer(torch.bfloat16, N=50)
    lin._native = False
    x = torch.randn(5, 80)
    close(lin(x), F.linear(x.double(), lin.table.double(), lin.bias.double()), 80)


@DTYPES
def test_an_input_that_needs_its_gradient_gets_it(dtype):
    lin = layer(dtype)
    x = torch.randn(2, 80, requires_grad=True)
    lin(x).sum().backward()
    assert torch.allclose(x.grad, lin.table.float().sum(0).expand(2, 80))


@DTYPES
def test_what_it_shows_and_holds(dtype):
    lin = layer(dtype, N=48, K=80)
    assert lin.weight.shape == (48, 80) and lin.weight.dtype == torch.float32
    assert lin.nbytes == 48 * 80 * 2 + 48 * 4
    assert lin.weights_format == "gguf"
    assert ("F16" if dtype == torch.float16 else "BF16") in repr(lin)
    with pytest.raises(TypeError, match="cannot be moved or converted"):
        lin.double()


@DTYPES
def test_the_embedding_looks_up_widened_rows(dtype):
    table = torch.randn(30, 16).to(dtype)
    emb = HalfEmbedding(table)
    ids = torch.tensor([[3, 0, 29], [7, 7, 1]])
    got = emb(ids)
    assert got.dtype == torch.float32 and torch.equal(got, table.float()[ids])
    assert emb.weight.shape == (30, 16) and emb.weight.dtype == torch.float32
    with pytest.raises(TypeError, match="cannot be moved or converted"):
        emb.to(torch.float64)


@pytest.mark.parametrize(
    "table",
    [torch.zeros(4, 8), torch.zeros(8, dtype=torch.float16), torch.zeros(2, 2, 2).half()],
    ids=["fp32", "1-D", "3-D"],
)
def test_a_table_that_is_not_a_16_bit_matrix_is_refused(table):
    for make in (lambda t: HalfLinear(t, None), HalfEmbedding):
        with pytest.raises(
            ValueError, match=r"(table|parts\[0\]) must be a 2-D fp16 or bf16 tensor.*got"
        ):
            make(table)
