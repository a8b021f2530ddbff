"""Greedy decoding's pick in the native kernel (dikkat.kernels, ``argmax_rows``), against
``torch.argmax``: ties go to the first, a NaN counts as the largest, rows of any length; and
:func:`dikkat.generation.sampler.largest`, which uses it where it is loaded."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from dikkat import kernels as native
from dikkat.generation.sampler import largest
from native_builds import LESSER, portable_build, run_with


@pytest.fixture
def op():
    if native.qmm_op() is None:  # the machines the suite runs on build it
        pytest.skip("no native kernels here")
    found = native.argmax_op()
    assert found is not None  # loaded with the library
    return found


def hard_rows(V: int, g: torch.Generator) -> torch.Tensor:
    """Rows that test the rule: random, a tie at the top, a NaN (two), ±inf, all equal."""
    x = torch.randn(9, V, generator=g)
    x[1, V // 3], x[1, V - 1] = 9.0, 9.0  # a tie: the first wins
    x[2, V // 2] = float("nan")
    x[3, V - 1], x[3, 0] = float("nan"), float("nan")
    x[4] = float("-inf")
    x[5, V // 4] = float("inf")
    x[6] = 0.0
    x[7, V // 5], x[7, V - 1] = -0.0, 30.0
    x[8] = -torch.arange(V, dtype=torch.float32)  # the first value is the largest
    return x


@pytest.mark.parametrize("V", [1, 2, 15, 16, 17, 33, 1000, 50257])
def test_each_rows_pick_is_torchs(op, V):
    x = hard_rows(V, torch.Generator().manual_seed(V))
    got = op(x)
    assert got.dtype == torch.long and got.shape == (9,)
    assert torch.equal(got, x.argmax(dim=-1))
    strided = torch.stack([x, -x], dim=-1).view(9, 2 * V)[:, ::2]  # x, not contiguous
    assert torch.equal(op(strided), x.argmax(dim=-1))


def test_largest_uses_it_where_it_fits(op):
    x = hard_rows(300, torch.Generator().manual_seed(1))
    assert torch.equal(largest(x), x.argmax(dim=-1))
    for other in (x.double(), x.bfloat16(), x.view(3, 3, 300), torch.zeros(2, 0)):
        if other.shape[-1] == 0:
            with pytest.raises((IndexError, RuntimeError)):  # torch's own refusal
                largest(other)
        else:
            assert torch.equal(largest(other), other.argmax(dim=-1))


def test_bad_inputs_are_refused(op):
    with pytest.raises(RuntimeError, match=r"x must be \(B, V\) fp32"):
        op(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="must not be empty"):
        op(torch.zeros(2, 0))


SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.ops.load_library(sys.argv[1])
    g = torch.Generator().manual_seed(0)
    for V in (1, 17, 50257):
        x = torch.randn(4, V, generator=g)
        x[1, -1] = x[1].max()  # a tie with an earlier value
        x[2, V // 2] = float("nan")
        assert torch.equal(torch.ops.dikkat_native.argmax_rows(x), x.argmax(-1)), V
    print("ok")
    """
)


@pytest.mark.parametrize("cpu", LESSER)
def test_the_portable_loop_gives_the_same_picks(tmp_path: Path, cpu: str):
    """The builds for a CPU without AVX-512 (AVX2) and without any vector extension."""
    source = Path(native.__file__).with_name("argmax.cpp")
    library = portable_build(tmp_path, [source], LESSER[cpu])
    assert run_with(library, SCRIPT).strip() == "ok"
