"""Every attention backend against the fp64 reference, forward and backward.

The rule is FlashAttention's: a backend run in dtype X may be at most twice as far from the
float64 oracle as the plain reference run in the same dtype X, plus a tiny floor. The oracle sees
the inputs exactly as X holds them, so the error measured is the computation's, not the rounding
of the inputs.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from hypothesis import assume, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from dikkat.core import attention, explain, masks, repeat_kv
from helpers import (
    MASK_KINDS,
    Case,
    Result,
    attention_cases,
    cpu_backends,
    max_err,
    oracle,
    run,
    term_sizes,
)

BACKENDS = cpu_backends(exact_only=True)  # the triton backend: tests/core/test_triton.py
DTYPES = [torch.float32, torch.bfloat16]
# The floor is a few roundings of the terms each entry sums (``term_sizes``): the error of a sum
# scales with Σ|terms|, not with the result, which can cancel (with one allowed key the
# reference's dq = dk = 0 exactly, while a kernel recomputing P = exp(s − logsumexp) is not).
# It matters where the plain reference happens to be (almost) exact, which on tensors this small
# is common: a max over a few entries is a noisy yardstick.
FLOOR = {
    # fp32, unit roundoff u = 2**-24: 32 u ≈ 2e-6, room for another summation order over up to
    # 24 keys · 3 heads. The worst seen over 3000 drawn cases was 8 u.
    torch.float32: 32 * 2**-24,
    # bf16 keeps 8 significant bits, u = 2**-9 ≈ 2e-3: two roundings more than the reference (a
    # fused kernel rounds P to bf16 before P·V, and in the backward takes D = rowsum(dO∘O) from
    # the stored bf16 output). The worst seen over 3000 drawn cases was 0.7 u, and over 3000
    # seeds each of two tiny shapes (T = 1, S = 2 and T = 11, S = 1) 1.1 u.
    torch.bfloat16: 2 * 2**-9,
}


class _DeclinedError(Exception):
    """A backend declined a drawn example."""


@contextlib.contextmanager
def _unless_declined(backend: str):
    """A backend other than the built-in two may decline a call it cannot serve (a GPU-only
    kernel, say): that call is no test of it. A plain test is then skipped; a drawn example is
    counted as a hypothesis event and passes (see ``_declined_examples_pass``)."""
    try:
        yield
    except ValueError as e:
        if backend in ("reference", "sdpa") or "cannot serve this call" not in str(e):
            raise
        if currently_in_test_context():
            event(f"{backend} declined")
            raise _DeclinedError from e
        pytest.skip(f"{backend} declines: {e}")


def _declined_examples_pass(test):
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        with contextlib.suppress(_DeclinedError):
            test(*args, **kwargs)

    return wrapper


def _run(case: Case, inputs, dtype: torch.dtype, backend: str) -> Result:
    with _unless_declined(backend):
        return run(case, inputs, dtype, backend)


def _check_two_x_rule(case: Case, dtype: torch.dtype, backend: str) -> Result:
    inputs = case.inputs()
    exact = oracle(case, inputs, dtype)
    plain = run(case, inputs, dtype, "reference")
    got = _run(case, inputs, dtype, backend)
    terms = term_sizes(case, inputs, dtype)
    for (name, x), (_, p), (_, e), (_, t) in zip(
        got.items(), plain.items(), exact.items(), terms.items(), strict=True
    ):
        assert x.dtype == dtype and x.shape == e.shape, name
        assert torch.isfinite(x).all(), f"{name} has non-finite entries"
        bound = 2 * max_err(p, e) + FLOOR[dtype] * t.max().item()
        err = max_err(x, e)
        assert err <= bound, f"{backend} {name} in {dtype}: error {err:.3g} > bound {bound:.3g}"
    return got


def _check_empty_rows(case: Case, got: Result) -> None:
    """Queries with no allowed key give output exactly 0 and a query gradient exactly 0."""
    empty = case.empty_rows()  # (B, H, T, 1)
    assert (got.out.masked_select(empty) == 0).all()
    assert (got.dq.masked_select(empty) == 0).all()


# --- the 2× rule ---------------------------------------------------------------------------------


# flex runs eagerly on tensors this small and traces a fresh graph for every mask, ≈ 0.3 s a
# case: it draws fewer cases here (test_flex.py checks it against the oracle mask by mask)
SLOW = {"flex"}


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in SLOW])
@given(data=st.data())
@_declined_examples_pass
def test_backend_matches_fp64_oracle(backend: str, dtype: torch.dtype, mask_kind: str, data):
    _drawn_case_obeys_the_rule(backend, dtype, mask_kind, data)


def _drawn_case_obeys_the_rule(backend: str, dtype: torch.dtype, mask_kind: str, data) -> None:
    case = data.draw(attention_cases(mask_kind=mask_kind), label="case")
    got = _check_two_x_rule(case, dtype, backend)
    _check_empty_rows(case, got)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", sorted(SLOW & set(BACKENDS)))
@settings(max_examples=4)
@given(data=st.data())
@_declined_examples_pass
def test_slow_backend_matches_fp64_oracle(backend: str, dtype: torch.dtype, mask_kind: str, data):
    _drawn_case_obeys_the_rule(backend, dtype, mask_kind, data)


def _bias_case(bias_shape, mask, q_offset: int = 0) -> Case:
    return Case(2, 4, 2, 6, 9, 16, 8, q_offset, mask, bias_shape, seed=7)


BIAS_SHAPES = [(2, 4, 6, 9), (1, 4, 6, 9), (2, 1, 1, 9), (6, 9), (9,)]
BIAS_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "padding-with-empty": masks.padding(torch.tensor([0, 5])),
    "window": masks.sliding_window(3),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_name", BIAS_MASKS)
@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=str)
def test_bias_matches_fp64_oracle(backend, dtype, mask_name, bias_shape) -> None:
    case = _bias_case(bias_shape, BIAS_MASKS[mask_name], q_offset=2 if mask_name == "window" else 0)
    _check_empty_rows(case, _check_two_x_rule(case, dtype, backend))


# A bias in another dtype than q (an fp32 ALiBi table next to a bf16 model) is added in fp32:
# test_numerics_edge.py checks it, with the bias gradient of every backend.


# --- grouped-query attention ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_cases(), dtype=st.sampled_from([torch.float64, torch.float32]))
@_declined_examples_pass
def test_gqa_equals_mha_with_repeated_heads(backend: str, case: Case, dtype) -> None:
    assume(case.group > 1)
    inputs = case.inputs()
    q, k, v = (inputs[n].to(dtype).requires_grad_() for n in "qkv")
    bias = None if inputs["bias"] is None else inputs["bias"].to(dtype)
    dout = inputs["dout"].to(dtype)

    def forward_backward(kk, vv):
        kwargs = {"bias": bias, "q_offset": case.q_offset, "backend": backend}
        with _unless_declined(backend):
            out = attention(q, kk, vv, case.mask, **kwargs)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    grouped = forward_backward(k, v)
    # Key/value head g serves query heads g·group … g·group + group − 1; autograd sums the
    # gradients of the copies back into k and v.
    repeated = forward_backward(
        k.repeat_interleave(case.group, dim=1), v.repeat_interleave(case.group, dim=1)
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), grouped, repeated, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


# --- fully masked rows ---------------------------------------------------------------------------


def _no_key_for_row_2(B, H, T, S):
    allowed = torch.ones(B, H, T, S, dtype=torch.bool)
    allowed[:, :, 2] = False
    return allowed


# name -> (T, S, q_offset, mask); every one leaves some query with no key at all.
EMPTY_ROW_MASKS = {
    "padding-length-0": (5, 6, 0, masks.padding(torch.tensor([0, 4]))),
    "padding-valid-none": (5, 6, 0, masks.padding(valid=torch.tensor([[True] * 6, [False] * 6]))),
    "not-causal": (5, 5, 0, ~masks.causal()),
    "dense-row": (5, 6, 0, _no_key_for_row_2(2, 4, 5, 6)),
    "window-and-padding-decoding": (
        3,
        6,
        3,
        masks.sliding_window(2) & masks.padding(torch.tensor([3, 6])),
    ),
    "document-past-the-keys": (7, 4, 0, masks.document(torch.tensor([0, 0, 1, 1, 2, 2, 3]))),
    "everything": (5, 6, 0, torch.zeros(1, dtype=torch.bool)),
}


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_name", EMPTY_ROW_MASKS)
def test_fully_masked_rows_give_zero_and_finite_gradients(backend, dtype, mask_name, with_bias):
    T, S, q_offset, mask = EMPTY_ROW_MASKS[mask_name]
    case = Case(2, 4, 2, T, S, 8, 8, q_offset, mask, (1, 4, T, S) if with_bias else None, seed=3)
    assert case.empty_rows().any(), "the case must have an empty row"
    got = _run(case, case.inputs(), dtype, backend)
    for name, x in got.items():
        assert torch.isfinite(x).all(), f"{name} has non-finite entries"
    _check_empty_rows(case, got)


# --- returned weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("backend", ["reference", "auto"])
@given(case=attention_cases())
def test_weights_are_a_distribution_and_give_the_output(backend, dtype, case: Case) -> None:
    inputs = case.inputs()
    q, k, v = (inputs[n].to(dtype) for n in "qkv")
    bias = None if inputs["bias"] is None else inputs["bias"].to(dtype)
    out, (w, _) = attention(
        q, k, v, case.mask, bias=bias, q_offset=case.q_offset, backend=backend, return_weights=True
    )
    assert w.shape == (case.B, case.H, case.T, case.S) and w.dtype == dtype
    assert (w >= 0).all()
    assert (w.masked_select(~case.allowed()) == 0).all(), "a masked key got weight"
    empty = case.empty_rows().squeeze(-1)  # (B, H, T)
    sums = w.sum(dim=-1)
    assert (sums[empty] == 0).all()
    torch.testing.assert_close(sums[~empty], torch.ones_like(sums[~empty]))
    torch.testing.assert_close(out, w @ repeat_kv(v, case.group))


# --- auto dispatch -------------------------------------------------------------------------------


def _explained_backend(case: Case, inputs, return_weights: bool) -> str:
    text = explain(
        *(inputs[n] for n in "qkv"),
        case.mask,
        bias=inputs["bias"],
        q_offset=case.q_offset,
        return_weights=return_weights,
    )
    name = text.split(" ", 1)[0]
    assert name in BACKENDS, text
    return name


@given(case=attention_cases(), return_weights=st.booleans())
def test_auto_gives_what_the_backend_it_picks_gives(case: Case, return_weights: bool) -> None:
    inputs = case.inputs()
    chosen = _explained_backend(case, inputs, return_weights)
    if return_weights:
        assert chosen == "reference"

    def call(backend):
        return attention(
            *(inputs[n] for n in "qkv"),
            case.mask,
            bias=inputs["bias"],
            q_offset=case.q_offset,
            backend=backend,
            return_weights=return_weights,
        )

    auto, direct = call("auto"), call(chosen)
    if return_weights:
        assert torch.equal(auto[0], direct[0])
        assert torch.equal(auto[1].weights, direct[1].weights)
    else:
        assert torch.equal(auto, direct)


def test_explain_names_reference_when_weights_are_requested() -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    assert explain(q, k, v, masks.causal(), return_weights=True).startswith("reference")
    without = explain(q, k, v, masks.causal())
    assert without.split(" ", 1)[0] in BACKENDS


def test_sdpa_refuses_to_return_weights() -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"'sdpa' cannot serve this call: .*weights"):
        attention(q, k, v, backend="sdpa", return_weights=True)


def test_unknown_backend_lists_the_choices() -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"unknown backend 'flashy'") as info:
        attention(q, k, v, backend="flashy")
    for name in ["auto", *BACKENDS]:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_layout_does_not_matter(backend: str) -> None:
    # q, k, v as a (B, T, H, D) projection transposed to (B, H, T, D): strided views, as models
    # pass them; a transposed mask and bias likewise.
    B, H, G, T, S, D = 2, 4, 2, 5, 6, 8
    q = torch.randn(B, T, H, D).transpose(1, 2)
    k, v = (torch.randn(B, S, G, D).transpose(1, 2) for _ in range(2))
    mask = (torch.rand(S, T) < 0.7).t()
    bias = torch.randn(S, T).t()
    with _unless_declined(backend):
        strided = attention(q, k, v, mask, bias=bias, backend=backend)
    packed = attention(
        *(t.contiguous() for t in (q, k, v)),
        mask.contiguous(),
        bias=bias.contiguous(),
        backend=backend,
    )
    torch.testing.assert_close(strided, packed, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.05, 0.3, 2.0])
def test_scale_multiplies_the_scores(backend: str, scale: float) -> None:
    # softmax(q·kᵀ · scale) is softmax((q · scale·√D)·kᵀ / √D): the default scale is 1/√D.
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 5, 16, generator=g, dtype=torch.float64) for _ in range(3))
    with _unless_declined(backend):
        got = attention(q, k, v, masks.causal(), scale=scale, backend=backend)
    want = attention(q * scale * 16**0.5, k, v, masks.causal(), backend="reference")
    torch.testing.assert_close(got, want)
