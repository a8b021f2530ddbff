"""A bias, every backend against the fp64 reference: a learnable bias gets its gradient (the
tiled backend once treated it as a constant), and a large bias (ALiBi) is added in fp32 for bf16
queries, not rounded to bf16 first.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D`` head dim.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dikkat.core import attention, explain, masks
from helpers import Case, cpu_backends, dbias_terms, max_err

EXACT = cpu_backends(exact_only=True)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():  # flex warns that it runs eagerly: deliberate here
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


# --- a learnable bias: its gradient from every backend --------------------------------------------

# every dim of its own, heads and keys (broadcast over batch and rows), one value per row
BIAS_SHAPES = [(2, 4, 6, 9), (4, 1, 9), (1, 4, 6, 1)]
BIAS_MASKS = {
    "none": None,
    "window": masks.sliding_window(3),
    "padding-with-empty": masks.padding(torch.tensor([0, 5])),
}
# a few roundings of the terms dS sums (as FLOOR in test_backends.py)
FLOOR = {torch.float32: 32 * 2**-24, torch.bfloat16: 2 * 2**-9}


def _bias_case(bias_shape, mask) -> Case:
    return Case(2, 4, 2, 6, 9, 16, 8, 0, mask, bias_shape, seed=13)


def _bias_grad(case: Case, x, dtype: torch.dtype, backend: str, bias_dtype=None):
    """(out, dbias) of a call in ``dtype`` with a bias that requires grad."""
    q, k, v = (x[n].to(dtype) for n in "qkv")
    bias = x["bias"].to(bias_dtype or dtype).requires_grad_()
    out = _quiet(attention, q, k, v, case.mask, bias=bias, backend=backend)
    assert out.grad_fn is not None, "only the bias requires grad: the output must still have one"
    (dbias,) = torch.autograd.grad(out, bias, x["dout"].to(dtype))
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    return out, dbias


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("mask_name", BIAS_MASKS)
@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=str)
def test_bias_gradient_matches_the_fp64_oracle(backend, mask_name, bias_shape, dtype) -> None:
    # the tiled backend once treated the bias as a constant: grad None
    case = _bias_case(bias_shape, BIAS_MASKS[mask_name])
    x = {n: None if t is None else t.to(dtype).double() for n, t in case.inputs().items()}
    _, exact = _bias_grad(case, x, torch.float64, "reference")
    if dtype == torch.float64:
        _, got = _bias_grad(case, x, dtype, backend)
        torch.testing.assert_close(got, exact, atol=1e-12, rtol=1e-10)
        return
    # an fp32 bias next to fp32 or bf16 q (it is added in fp32 either way)
    _, got = _bias_grad(case, x, dtype, backend, bias_dtype=torch.float32)
    assert torch.isfinite(got).all()
    _, plain = _bias_grad(case, x, dtype, "reference", bias_dtype=torch.float32)
    bound = 2 * max_err(plain, exact) + FLOOR[dtype] * dbias_terms(case, x).max().item()
    err = max_err(got, exact)
    assert err <= bound, f"{backend} dbias in {dtype}: error {err:.3g} > bound {bound:.3g}"


def test_auto_sends_a_sparse_call_with_a_learnable_bias_somewhere_that_trains_it() -> None:
    # a long call with a narrow window: auto picks tiled, which once dropped the bias gradient
    T = 1024
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, T, 8, generator=g) for _ in range(3))
    rel = torch.randn(1, 1, 1, T, generator=g).requires_grad_()
    mask = masks.sliding_window(16)
    assert explain(q, k, v, mask, bias=rel).startswith("tiled")
    (got,) = torch.autograd.grad(attention(q, k, v, mask, bias=rel).sum(), rel)
    (want,) = torch.autograd.grad(attention(q, k, v, mask, bias=rel, backend="sdpa").sum(), rel)
    torch.testing.assert_close(got, want)


# --- a large bias in bf16 is added in fp32 -------------------------------------------------------


def _alibi(H: int, T: int, S: int) -> torch.Tensor:
    """Flash-attention's causal ALiBi form: slope_h · (j − (S − 1)), the same in every row, down
    to −slope·(S − 1) far from the end (T = S: early rows see only those keys)."""
    slopes = torch.tensor([1.0, 0.5, 0.25, 0.125][:H])
    return (slopes.view(H, 1, 1) * (torch.arange(S) - (S - 1)).view(1, 1, S)).expand(H, T, S)


def _plain_fp32_bias(q, k, v, bias, scale: float) -> torch.Tensor:
    """A plain bf16 implementation that adds an fp32 bias to the scores in fp32."""
    scores = (q @ k.transpose(-2, -1)) * scale
    T, S = scores.shape[-2:]
    scores = scores.float() + bias
    scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("backend", EXACT)
def test_an_alibi_bias_in_bf16_meets_the_two_x_rule(backend: str) -> None:
    H, T, D = 4, 512, 16
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, H, T, D, generator=g).bfloat16() for _ in range(3))
    bias = _alibi(H, T, T)
    exact = attention(
        q.double(), k.double(), v.double(), masks.causal(), bias=bias.double(), backend="reference"
    )
    plain = _plain_fp32_bias(q, k, v, bias, 1 / math.sqrt(D))
    got = _quiet(attention, q, k, v, masks.causal(), bias=bias, backend=backend)
    rounded = attention(q, k, v, masks.causal(), bias=bias.bfloat16(), backend="reference")
    assert got.dtype == torch.bfloat16
    err, bound = max_err(got, exact), 2 * max_err(plain, exact) + 2 * 2**-9
    assert err <= bound, f"{backend}: error {err:.3g} > bound {bound:.3g}"
    # not trivially true: the bias rounded to bf16 (steps of 2 near −300) is far worse
    assert max_err(rounded, exact) > 20 * err


@pytest.mark.parametrize("backend", EXACT)
def test_a_bias_of_any_float_dtype_is_added_in_fp32_for_bf16_queries(backend: str) -> None:
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 6, 16, generator=g).bfloat16() for _ in range(3))
    bias = torch.randn(4, 6, 6, generator=g, dtype=torch.float64) * 50
    fp32 = _quiet(attention, q, k, v, masks.causal(), bias=bias.float(), backend=backend)
    # fp64 is rounded to fp32 once; bf16 is widened exactly: the same as handing fp32 over
    fp64 = _quiet(attention, q, k, v, masks.causal(), bias=bias, backend=backend)
    torch.testing.assert_close(fp64, fp32, rtol=0, atol=0)
    b16 = bias.bfloat16()
    got = _quiet(attention, q, k, v, masks.causal(), bias=b16, backend=backend)
    want = _quiet(attention, q, k, v, masks.causal(), bias=b16.float(), backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
