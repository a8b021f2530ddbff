"""Every backend on inputs in any memory layout: q, k, v, the bias and the output's gradient as
transposed, sliced, expanded and channels-last views (tests/layouts.py), forward and backward,
against the fp64 oracle on the same values by test_backends.py's 2× rule. Models hand such views
over (a key transposed for q·kᵀ, q, k and v cut from one fused projection, the gradient of a
``.sum()`` expanded from a scalar); PyTorch's fused CPU flash kernel, which the tiled backend
runs, reads a strided last dim wrongly unless given a copy (docs/attention.md, "tiled").
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dikkat.core import attention, masks
from helpers import (
    Case,
    attention_cases,
    cpu_backends,
    dbias_terms,
    max_err,
    oracle,
    rounded,
    run,
    term_sizes,
)
from layouts import CONTIGUOUS, layouts, relaid, run_relaid, values

BACKENDS = [*cpu_backends(exact_only=True), "auto"]  # triton: tests/core/test_triton.py
SLOW = {"flex"}  # ≈ 0.3 s a case eagerly, as in test_backends.py: fewer cases
DTYPES = [torch.float32, torch.bfloat16]
FLOOR = {torch.float32: 32 * 2**-24, torch.bfloat16: 2 * 2**-9}  # as in test_backends.py
TENSORS = ("q", "k", "v", "bias", "dout")


def _check_relaid(case: Case, lay: dict, dtype: torch.dtype, backend: str) -> None:
    x = values(case.inputs(), lay)
    exact = oracle(case, x, dtype)
    plain = run(case, x, dtype, "reference")
    terms = term_sizes(case, x, dtype)
    got, dbias = run_relaid(case, x, dtype, backend, lay, bias_grad=True)
    for (name, g), (_, p), (_, e), (_, t) in zip(
        got.items(), plain.items(), exact.items(), terms.items(), strict=True
    ):
        assert g.dtype == dtype and g.shape == e.shape, name
        bound = 2 * max_err(p, e) + FLOOR[dtype] * t.max().item()
        err = max_err(g, e)
        assert err <= bound, f"{backend} {name} in {dtype}: error {err:.3g} > bound {bound:.3g}"
    if dbias is None:
        return
    exact_b = run_relaid(case, rounded(x, dtype), torch.float64, "reference", CONTIGUOUS,
                         bias_grad=True)[1]  # fmt: skip
    plain_b = run_relaid(case, x, dtype, "reference", CONTIGUOUS, bias_grad=True)[1]
    bound = 2 * max_err(plain_b, exact_b) + FLOOR[dtype] * dbias_terms(case, x).max().item()
    err = max_err(dbias, exact_b)
    assert err <= bound, f"{backend} dbias in {dtype}: error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in SLOW])
@given(case=attention_cases(), lay=layouts(*TENSORS))
def test_any_layout_obeys_the_two_x_rule(backend: str, dtype: torch.dtype, case: Case, lay):
    _check_relaid(case, lay, dtype, backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", sorted(SLOW & set(BACKENDS)))
@settings(max_examples=3)
@given(case=attention_cases(), lay=layouts(*TENSORS))
def test_any_layout_obeys_the_two_x_rule_slow(backend: str, dtype: torch.dtype, case: Case, lay):
    _check_relaid(case, lay, dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_transposed_key_as_a_new_user_writes_it(backend: str) -> None:
    """``torch.randn(1, 2, 8, 10).transpose(-1, -2)``: a key whose last dim is strided."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 8, 10, generator=g, dtype=torch.float64).transpose(-1, -2)
    k.requires_grad_()
    out = attention(q, k, q, backend=backend)
    grads = torch.autograd.grad(out.sum(), (q, k))  # the .sum()'s gradient: stride 0
    kc = k.detach().contiguous().requires_grad_()
    qc = q.detach().clone().requires_grad_()
    want = attention(qc, kc, qc, backend="reference")
    want_grads = torch.autograd.grad(want.sum(), (qc, kc))
    torch.testing.assert_close(out, want)
    for got, exact in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, exact)


@given(
    lay=layouts("q", "k", "v", "dout"),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_attention_does_not_depend_on_the_layout(lay, causal: bool, seed: int) -> None:
    """Linear attention is another model: each layout against its own result on contiguous
    tensors of the same values, in fp64."""
    case = Case(2, 4, 2, 7, 7, 8, 16, 0, masks.causal() if causal else None, None, seed)
    x = values(case.inputs(), lay)  # no bias: linear attention takes none
    got, _ = run_relaid(case, x, torch.float64, "linear", lay)
    want, _ = run_relaid(case, x, torch.float64, "linear", CONTIGUOUS)
    assert want.out.abs().max() > 0.1  # not a comparison of two zeros
    for (name, a), (_, b) in zip(got.items(), want.items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_every_layout_is_what_it_says() -> None:
    """The layouts are not contiguous copies in disguise, and keep the values (an expanded
    view repeats its first slice)."""
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    strides = {
        "transposed": (60, 20, 1, 5),
        "column_major": (1, 2, 6, 30),
        "channels_last": (60, 1, 12, 3),
        "every_other": (120, 40, 8, 2),
        "narrowed": (105, 35, 7, 1),
        "expanded": (0, 20, 4, 1),
    }
    for layout, want in strides.items():
        y = relaid(x, layout, 0)
        assert y.stride() == want, layout
        same = x[:1].expand_as(x) if layout == "expanded" else x
        assert torch.equal(y, same), layout
