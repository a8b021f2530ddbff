"""Decoding's fp32 product in the native kernel (dikkat.kernels, ``linear_rows``) against the
fp64 product: rows of any length (the 32-value steps, the masked tail), weights of any number of
rows (the four-row blocks, the rows left over), fp32, fp16 and bf16 weights (read row by row for
a few rows of x, widened a slice at a time for more), strided inputs, no bias, empty shapes; and
the builds for a CPU without AVX-512, which run the AVX2 and the plain loops."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dikkat import kernels as native
from native_builds import LESSER, portable_build, run_with


@pytest.fixture
def op():
    found = native.linear_rows_op()
    if found is None:  # the machines the suite runs on build it
        pytest.skip("no native kernels here")
    return found


def within_fp32(got: torch.Tensor, want: torch.Tensor, K: int) -> None:
    """``got`` (fp32) is ``want`` (fp64) up to the rounding of K fp32 products and their sum."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    if want.numel():
        scale = want.abs().max().item() + 1.0
        assert (got.double() - want).abs().max().item() <= 4e-7 * (K + 4) * scale


@pytest.mark.parametrize("K", [1, 15, 16, 17, 32, 33, 100, 773])
@pytest.mark.parametrize("N", [1, 3, 4, 9, 70])
@pytest.mark.parametrize("M", [1, 2, 3])
def test_the_product_is_the_fp64_product(op, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64)
    b = torch.randn(N, generator=g, dtype=torch.float64)
    within_fp32(op(x.float(), w.float(), b.float()), F.linear(x, w, b), K)
    within_fp32(op(x.float(), w.float(), None), F.linear(x, w), K)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("M", "N", "K"), [(1, 9, 33), (1, 70, 773), (3, 5, 16), (7, 4, 100),
                                           (8, 70, 64), (40, 1100, 4096)])  # fmt: skip
def test_a_16_bit_weight_is_widened_exactly(op, dtype, M, N, K):
    """Row by row below 8 rows of x, in slices widened for ATen's product from 8 on (the last
    shape takes three slices): the fp64 product of the widened weight either way."""
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g)
    want = F.linear(x.double(), w.double(), b.double())
    within_fp32(op(x, w, b), want, K)
    within_fp32(op(x, w, None), want - b.double(), K)
    strided = torch.randn(N, K + 3, generator=g).to(dtype)[:, 1:-2]
    strided.copy_(w)
    assert torch.equal(op(x, strided, b), op(x, w, b))


def test_strided_inputs_give_the_contiguous_products(op):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(40, 100, generator=g)
    w = big[3:29, 10:90]  # its rows 100 values apart: read in place
    x = torch.randn(80, 2, generator=g).t()  # (2, 80), not contiguous
    b = torch.randn(52, generator=g)[::2]
    want = op(x.contiguous(), w.contiguous(), b.contiguous())
    assert torch.equal(op(x, w, b), want)
    within_fp32(want, F.linear(x.double(), w.double(), b.double()), 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 12])  # rows read one by one; from 8, widened slices
def test_into_writes_its_columns_of_a_wider_output_and_nothing_else(op, dtype, M):
    """``linear_rows_into`` gives what ``linear_rows`` gives, in a block of columns of a wider
    matrix (a layer held in parts writes each part's columns), leaving the others as they were."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 40, generator=g)
    w = torch.randn(30, 40, generator=g).to(dtype)
    b = torch.randn(30, generator=g)
    wide = torch.full((M, 50), 7.0)
    torch.ops.dikkat_native.linear_rows_into(x, w, b, wide[:, 11:41])
    assert torch.equal(wide[:, 11:41], op(x, w, b))
    assert (wide[:, :11] == 7).all() and (wide[:, 41:] == 7).all()
    with pytest.raises(RuntimeError, match=r"out must be \(M, N\) fp32, each row contiguous"):
        torch.ops.dikkat_native.linear_rows_into(x, w, b, wide[:, :30].t())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_prompt_s_strided_rows_through_widened_slices(op, dtype):
    """12 rows (widened slices, oneDNN's product) whose rows lie 100 values apart, or whose
    columns are contiguous: what the contiguous rows give."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(30, 80, generator=g).to(dtype), torch.randn(30, generator=g)
    x = torch.randn(12, 100, generator=g)[:, 10:90]
    want = op(x.contiguous(), w, b)
    assert torch.equal(op(x, w, b), want)
    assert torch.equal(op(x.contiguous().t().contiguous().t(), w, b), want)
    within_fp32(want, F.linear(x.double(), w.double(), b.double()), 80)


def test_empty_shapes_are_what_f_linear_gives(op):
    b = torch.randn(5)
    assert torch.equal(op(torch.zeros(2, 0), torch.zeros(5, 0), b), b.expand(2, 5))
    assert torch.equal(op(torch.zeros(2, 0), torch.zeros(5, 0), None), torch.zeros(2, 5))
    assert op(torch.zeros(0, 8), torch.zeros(5, 8), None).shape == (0, 5)
    assert op(torch.zeros(3, 8), torch.zeros(0, 8), None).shape == (3, 0)


def test_bad_inputs_are_refused(op):
    with pytest.raises(RuntimeError, match=r"x must be \(M, K\) fp32"):
        op(torch.zeros(1, 4, dtype=torch.float64), torch.zeros(2, 4), None)
    with pytest.raises(RuntimeError, match=r"w must be \(N, K\) fp32, fp16 or bf16"):
        op(torch.zeros(1, 4), torch.zeros(2, 4, 1), None)
    with pytest.raises(RuntimeError, match=r"w must be \(N, K\) fp32, fp16 or bf16"):
        op(torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="must share K"):
        op(torch.zeros(1, 4), torch.zeros(2, 5), None)
    with pytest.raises(RuntimeError, match=r"bias must be \(N,\) fp32"):
        op(torch.zeros(1, 4), torch.zeros(2, 4), torch.zeros(3))


SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.ops.load_library(sys.argv[1])
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for M, N, K in ((1, 1, 1), (1, 9, 33), (2, 70, 773), (3, 6, 16)):
        x = torch.randn(M, K, generator=g, dtype=torch.float64)
        w = torch.randn(N, K, generator=g, dtype=torch.float64)
        b = torch.randn(N, generator=g, dtype=torch.float64)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            wide = w.to(dtype).double()  # what the weight holds
            got = torch.ops.dikkat_native.linear_rows(x.float(), w.to(dtype), b.float()).double()
            want = torch.nn.functional.linear(x, wide, b)
            worst = max(worst, ((got - want).abs().max() / (want.abs().max() + 1) / (K + 4)).item())
    x, w = torch.randn(2, 33, generator=g), torch.randn(5, 33, generator=g)
    x[0, 7], x[1, 32], w[1, 7] = float("inf"), float("nan"), 0.0  # Inf · 0: NaN
    got = torch.ops.dikkat_native.linear_rows(x, w, None)
    want = (x.double()[:, None] * w.double()[None]).sum(-1)  # fp64, term by term
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(got), test(want)), (got, want)
    print(worst)
    """
)


@pytest.mark.parametrize("cpu", LESSER)
def test_the_portable_loops_give_the_same_products(tmp_path: Path, cpu: str):
    """The builds for a CPU without AVX-512 (AVX2) and without any vector extension, which keep
    a NaN or ±Inf as IEEE arithmetic does too."""
    source = Path(native.__file__).with_name("linear.cpp")
    library = portable_build(tmp_path, [source], LESSER[cpu])
    assert float(run_with(library, SCRIPT).strip().splitlines()[-1]) < 4e-7
