"""Edge numerics, every backend against the fp64 reference: NaN and ±∞ in the inputs (the rule
of ``dikkat.core.attention``), zero-size inputs, and linear attention's padded chunks and empty
key sets. (The bias's gradient and its precision: ``test_bias.py``.)

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dikkat.core import attention, masks, repeat_kv
from dikkat.core.linear import linear_attention_quadratic
from helpers import Case, attention_cases, cpu_backends

EXACT = cpu_backends(exact_only=True)
BACKENDS = cpu_backends()
NONFINITE = (float("nan"), float("inf"), float("-inf"))
# flex runs eagerly on tensors this small and traces a graph per mask (≈ 0.3 s a case)
SLOW = {"flex"}


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():  # flex warns that it runs eagerly: deliberate here
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


def _declines(backend: str, error: ValueError) -> bool:
    """A backend may decline what it cannot serve (sdpa: no lse; flex on CPU: no lse)."""
    return backend not in ("reference", "tiled") and "cannot serve this call" in str(error)


# --- linear attention: padded chunks and no keys ------------------------------------------------


@pytest.mark.parametrize("T", [1, 63, 65, 70, 130])
def test_causal_linear_gradients_are_finite_and_exact_past_a_chunk_boundary(T: int) -> None:
    # T not a multiple of the chunk (64): the last chunk is zero-padded, and its padded rows
    # once computed 0/0, whose backward put NaN into k.grad and v.grad.
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, masks.causal(), backend="linear")
    got = torch.autograd.grad(out, leaves, dout)
    oracle = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(linear_attention_quadratic(*oracle, causal=True), oracle, dout)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert torch.isfinite(a).all(), f"d{name} has non-finite entries"
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


def test_linear_attention_with_no_keys_gives_zeros_like_every_backend() -> None:
    q = torch.randn(2, 2, 5, 8, requires_grad=True)
    k = torch.randn(2, 2, 0, 8, requires_grad=True)
    v = torch.randn(2, 2, 0, 4, requires_grad=True)
    out = attention(q, k, v, backend="linear")
    assert out.shape == (2, 2, 5, 4)
    assert (out == 0).all(), "no keys: output 0, as the softmax backends give"
    out.sum().backward()
    assert q.grad is not None and (q.grad == 0).all()


# --- NaN and ±∞: the reach rule ------------------------------------------------------------------


def _reached(case: Case, x: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """(B, H, T): the rule, written out on the dense mask — row i reaches q_i, the key/value rows
    its mask allows and the bias cells (i, j) its mask allows; NaN and +∞ count in the bias."""
    allowed = case.allowed()  # (B, H, T, S)
    reached = ~torch.isfinite(x["q"]).all(-1)
    bad_kv = ~(torch.isfinite(x["k"]).all(-1) & torch.isfinite(x["v"]).all(-1))  # (B, G, S)
    bad_kv = repeat_kv(bad_kv.unsqueeze(-1), case.group).squeeze(-1)  # (B, H, S)
    reached |= (allowed & bad_kv.unsqueeze(2)).any(-1)
    if x["bias"] is not None:
        b = x["bias"]
        bad = (torch.isnan(b) | torch.isposinf(b)).expand(allowed.shape)
        reached |= (allowed & bad).any(-1)
    return reached


def _finite_stand_in(x: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The inputs with each non-finite entry replaced by 3 (not dikkat's own 0: the rows that do
    not reach one must not depend on what it is); −∞ in the bias stays, a hidden key."""
    out = {}
    for name, t in x.items():
        if t is None or name == "dout":
            out[name] = t
        elif name == "bias":
            out[name] = torch.where(torch.isnan(t) | torch.isposinf(t), 3.0, t)
        else:
            out[name] = torch.where(torch.isfinite(t), t, 3.0)
    return out


@st.composite
def planted(draw, case: Case) -> dict[str, torch.Tensor | None]:
    """The case's fp64 inputs with one to three NaN/±∞ entries at drawn places."""
    x = case.inputs()
    targets = ["q", "k", "v"] + (["bias"] if x["bias"] is not None else [])
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(targets))
        t = x[name] = x[name].clone()
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(NONFINITE))
    return x


# "padding" draws lengths of 0 (a sequence whose every row sees no key), "not" ~causal & co.
RULE_MASKS = ("none", "causal", "sliding_window", "padding", "dense", "not")


def _check_reach_rule(backend: str, dtype: torch.dtype, case: Case, x) -> None:
    reached = _reached(case, x)  # (B, H, T)
    stand_in = _finite_stand_in(x)
    leaves = {n: x[n].to(dtype).requires_grad_() for n in "qkv"}
    bias = None if x["bias"] is None else x["bias"].to(dtype)
    kwargs = {"bias": bias, "q_offset": case.q_offset, "backend": backend}
    out = _quiet(attention, *leaves.values(), case.mask, **kwargs)
    assert out.dtype == dtype
    assert out[reached].isnan().all(), "a row that reaches a non-finite input must be NaN"
    with torch.no_grad():  # without autograd dikkat looks at fewer tensors: the same rule
        plain = _quiet(attention, *(t.detach() for t in leaves.values()), case.mask, **kwargs)
    torch.testing.assert_close(plain, out.detach(), equal_nan=True, rtol=0, atol=0)
    # the oracle: fp64 reference on the finite stand-in, the reached rows' gradient cut
    wants = {n: stand_in[n].clone().requires_grad_() for n in "qkv"}
    want = attention(
        *wants.values(),
        case.mask,
        bias=stand_in["bias"],
        q_offset=case.q_offset,
        backend="reference",
    )
    tol = {"atol": 1e-9, "rtol": 1e-9} if dtype == torch.float64 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out[~reached].double(), want[~reached].detach(), **tol)
    # a NaN row is a constant: whatever comes back through it must not reach q, k, v
    got_grads = torch.autograd.grad(out, list(leaves.values()), x["dout"].to(dtype))
    dout = x["dout"].masked_fill(reached.unsqueeze(-1), 0.0)
    want_grads = torch.autograd.grad(want, list(wants.values()), dout)
    for name, got, exact in zip("qkv", got_grads, want_grads, strict=True):
        finite = torch.isfinite(x[name])
        assert torch.isfinite(got).all(), f"d{name} has non-finite entries"
        assert (got[~finite] == 0).all(), f"d{name}: a non-finite entry got a gradient"
        torch.testing.assert_close(
            got.double().masked_fill(~finite, 0.0), exact.masked_fill(~finite, 0.0), **tol
        )


@pytest.mark.parametrize("mask_kind", RULE_MASKS)
@pytest.mark.parametrize("backend", [b for b in EXACT if b not in SLOW])
@given(data=st.data(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_nonfinite_inputs_reach_exactly_the_rows_that_see_them(backend, mask_kind, data, dtype):
    case = data.draw(attention_cases(mask_kind=mask_kind, max_len=12), label="case")
    _check_reach_rule(backend, dtype, case, data.draw(planted(case), label="inputs"))


@pytest.mark.parametrize("mask_kind", RULE_MASKS)
@pytest.mark.parametrize("backend", sorted(SLOW & set(EXACT)))
@settings(max_examples=2)
@given(data=st.data())
def test_nonfinite_rule_on_slow_backends(backend, mask_kind, data):
    case = data.draw(attention_cases(mask_kind=mask_kind, max_len=12), label="case")
    _check_reach_rule(backend, torch.float64, case, data.draw(planted(case), label="inputs"))


@given(data=st.data(), causal=st.booleans())
def test_linear_attention_follows_the_reach_rule(data, causal: bool) -> None:
    # linear attention's reach: every key, or the keys up to its own position when causal
    T = data.draw(st.integers(1, 70), label="T")
    S = T if causal else data.draw(st.integers(1, 12), label="S")
    case = Case(1, 2, 1, T, S, 4, 3, 0, masks.causal() if causal else None, None, seed=T + S)
    x = data.draw(planted(case), label="inputs")
    reached = _reached(case, x)
    out = attention(x["q"], x["k"], x["v"], case.mask, backend="linear")
    assert out[reached].isnan().all()
    s = _finite_stand_in(x)
    want = linear_attention_quadratic(s["q"], s["k"], s["v"], causal=causal)
    torch.testing.assert_close(out[~reached], want[~reached])


def _qkv(T: int = 4, S: int = 4, D: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 1, n, D, generator=g) for n in (T, S, S))


def _nan_rows(out: torch.Tensor) -> list[bool]:
    return out[0, 0].isnan().any(-1).tolist()


@pytest.mark.parametrize("backend", EXACT)
def test_a_nan_query_makes_its_own_row_nan(backend: str) -> None:
    # PyTorch's CPU flash kernel (sdpa, and tiled's tiles) once returned 0 for this row
    q, k, v = _qkv()
    q[0, 0, 1, 3] = float("nan")
    assert _nan_rows(_quiet(attention, q, k, v, backend=backend)) == [False, True, False, False]


@pytest.mark.parametrize("backend", EXACT)
def test_a_nan_key_hidden_by_the_causal_mask_changes_nothing(backend: str) -> None:
    # tiled once added its −∞ mask to the NaN score: NaN in every row
    q, k, v = _qkv()
    k[0, 0, 3, 0] = float("nan")  # only the last query sees key 3
    out = _quiet(attention, q, k, v, masks.causal(), backend=backend)
    assert _nan_rows(out) == [False, False, False, True]
    want = attention(q, k.nan_to_num(), v, masks.causal(), backend="reference")
    torch.testing.assert_close(out[:, :, :3], want[:, :, :3])


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_value_row_reaches_only_the_queries_that_see_it(backend: str, value: float) -> None:
    # 0 · NaN = NaN: a masked weight of 0 times the bad value row once poisoned every row
    q, k, v = _qkv()
    v[0, 0, 3, 2] = value
    out = _quiet(attention, q, k, v, masks.causal(), backend=backend)
    assert _nan_rows(out) == [False, False, False, True]
    assert torch.isfinite(out[:, :, :3]).all()


@pytest.mark.parametrize("backend", EXACT)
def test_an_infinite_key_that_scores_minus_inf_still_makes_its_rows_nan(backend: str) -> None:
    # q_i · k_j = −∞ gives key j weight 0: IEEE alone keeps such a row finite, though it reached
    # the infinity
    q, k, v = _qkv()
    q[..., 0] = q[..., 0].abs() + 0.1
    k[0, 0, 2] = 0.0
    k[0, 0, 2, 0] = float("-inf")
    out = _quiet(attention, q, k, v, masks.causal(), backend=backend)
    assert _nan_rows(out) == [False, False, True, True]


@pytest.mark.parametrize("backend", EXACT)
def test_minus_inf_in_the_bias_hides_a_key_and_is_no_error(backend: str) -> None:
    q, k, v = (t.double() for t in _qkv())
    bias = torch.zeros(4, 4, dtype=torch.float64)
    bias[1] = float("-inf")  # row 1: every key hidden, output 0
    bias[2, 0] = float("-inf")
    out = _quiet(attention, q, k, v, bias=bias, backend=backend)
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[1], allowed[2, 0] = False, False
    want = attention(q, k, v, allowed, backend="reference")
    assert torch.isfinite(out).all() and (out[0, 0, 1] == 0).all()
    torch.testing.assert_close(out, want)


def test_a_fully_masked_row_reaches_only_its_own_query() -> None:
    q, k, v = _qkv()
    mask = masks.padding(torch.tensor([0]))  # no row sees a key
    k[0, 0, 0, 0] = v[0, 0, 1, 1] = float("nan")
    for backend in EXACT:
        out = _quiet(attention, q, k, v, mask, backend=backend)
        assert (out == 0).all(), backend
    q[0, 0, 2, 0] = float("inf")
    out = attention(q, k, v, mask, backend="tiled")
    assert _nan_rows(out) == [False, False, True, False]


def test_weights_and_lse_of_a_reached_row_are_nan() -> None:
    q, k, v = _qkv()
    v[0, 0, 2, 0] = float("nan")
    _, (weights, lse) = attention(
        q, k, v, masks.causal(), backend="reference", return_weights=True, return_lse=True
    )
    assert weights[0, 0].isnan().all(-1).tolist() == [False, False, True, True]
    assert lse[0, 0].isnan().tolist() == [False, False, True, True]
    assert torch.isfinite(weights[0, 0, :2]).all()
    _, (_, lse_tiled) = attention(q, k, v, masks.causal(), backend="tiled", return_lse=True)
    torch.testing.assert_close(lse_tiled, lse, equal_nan=True)


# --- zero-size inputs ----------------------------------------------------------------------------

# name -> (B, H, G, T, S, D, Dv)
ZERO_SIZES = {
    "B=0": (0, 2, 1, 4, 5, 8, 8),
    "T=0": (1, 2, 1, 0, 5, 8, 8),
    "S=0": (1, 2, 1, 4, 0, 8, 8),
    "T=S=0": (1, 2, 1, 0, 0, 8, 8),
    "Dv=0": (1, 2, 1, 4, 5, 8, 0),
}


def _zero_size_call(sizes, backend: str, causal: bool, return_lse: bool):
    B, H, G, T, S, D, Dv = sizes
    g = torch.Generator().manual_seed(0)
    leaves = [
        torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
        for shape in ((B, H, T, D), (B, G, S, D), (B, G, S, Dv))
    ]
    mask = masks.causal() if causal else None
    q_offset = max(0, S - T) if causal else 0  # linear causal: the queries are the last keys
    result = _quiet(
        attention, *leaves, mask, q_offset=q_offset, backend=backend, return_lse=return_lse
    )
    out, (_, lse) = result if return_lse else (result, (None, None))
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    return out, lse, grads


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", ZERO_SIZES)
def test_zero_size_inputs_give_what_the_reference_gives(size, backend, causal, return_lse):
    sizes = ZERO_SIZES[size]
    try:
        out, lse, grads = _zero_size_call(sizes, backend, causal, return_lse)
    except ValueError as e:
        if not _declines(backend, e):
            raise
        pytest.skip(str(e))
    want, want_lse, want_grads = _zero_size_call(sizes, "reference", causal, return_lse)
    assert out.shape == want.shape and (out == 0).all()
    torch.testing.assert_close(out, want)
    if return_lse:
        torch.testing.assert_close(lse, want_lse)
    for name, got, exact in zip("qkv", grads, want_grads, strict=True):
        got = torch.zeros_like(exact) if got is None else got  # unused: a zero gradient
        torch.testing.assert_close(got, exact, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_head_dim_is_refused_with_its_size(backend: str) -> None:
    # D = 0 once divided by zero in the default scale 1/√D
    q, k, v = torch.randn(1, 2, 4, 0), torch.randn(1, 2, 5, 0), torch.randn(1, 2, 5, 3)
    with pytest.raises(
        ValueError, match=r"head dim D = 0; attention needs D ≥ 1: q \(1, 2, 4, 0\)"
    ):
        attention(q, k, v, backend=backend)
    with pytest.raises(ValueError, match=r"head dim D = 0"):
        attention(q, k, v, scale=0.5, backend=backend)
