"""dikkat.functional.scaled_dot_product_attention against torch's own function, argument by
argument: shapes, dtypes, strides, masks, scale, GQA, dropout, the error cases, forward and
backward; and the swap of torch.nn.functional's function for it.

Written from torch's documented contract (the scaled_dot_product_attention docs page); both are
held to an fp64 reference where the numbers matter, torch's kernels being no oracle.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import dikkat
from dikkat.functional import SDPAArgumentError, scaled_dot_product_attention

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention  # torch's, whatever F holds
BACKENDS = ("reference", "sdpa", "tiled", "auto")
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float64: 1e-12}


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fp64_sdpa(q, k, v, **kwargs) -> torch.Tensor:
    def up(x):
        return x.double() if isinstance(x, torch.Tensor) and x.dtype.is_floating_point else x

    mask = kwargs.get("attn_mask")
    if type(mask) is torch.Tensor and mask.dtype.is_floating_point:  # not a CausalBias
        kwargs["attn_mask"] = up(mask)
    return TORCH_SDPA(up(q), up(k), up(v), **kwargs)


def _check(q, k, v, backends=BACKENDS, **kwargs) -> None:
    """Each backend's drop-in equals torch's math in fp64 at least as well as torch does, plus
    the dtype's tolerance; the shapes are torch's."""
    want = _fp64_sdpa(q, k, v, **kwargs)
    theirs = TORCH_SDPA(q, k, v, **kwargs)
    floor = (theirs.double() - want).abs().max().item() if want.numel() else 0.0
    for backend in backends:
        got = scaled_dot_product_attention(q, k, v, **kwargs, backend=backend)
        assert got.shape == theirs.shape and got.dtype == theirs.dtype, backend
        if want.numel():
            err = (got.double() - want).abs().max().item()
            assert err <= 2 * floor + TOL[q.dtype], (backend, err, floor)


SHAPES = {
    "4-D": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)),
    "2-D": ((5, 8), (7, 8), (7, 8)),
    "3-D": ((3, 5, 8), (3, 7, 8), (3, 7, 8)),
    "5-D": ((2, 2, 3, 5, 8), (2, 2, 3, 7, 8), (2, 2, 3, 7, 8)),
    "keys for the whole batch": ((2, 3, 5, 8), (1, 3, 7, 8), (1, 3, 7, 8)),
    "one key head": ((2, 3, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8)),
    "one query head": ((2, 1, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
    "batch broadcast both ways": ((1, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
    "keys of lower rank": ((2, 3, 5, 8), (3, 7, 8), (3, 7, 8)),
    "no queries": ((2, 3, 0, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
}


@pytest.mark.parametrize("name", SHAPES)
def test_shapes_broadcast_as_torch_does(name: str) -> None:
    qs, ks, vs = SHAPES[name]
    _check(_rand(*qs), _rand(*ks, seed=1), _rand(*vs, seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_dtypes(dtype: torch.dtype, is_causal: bool) -> None:
    q, k, v = (_rand(2, 4, 9, 16, dtype=dtype, seed=s) for s in range(3))
    _check(q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "channels last"])
def test_strided_inputs(layout: str) -> None:
    base = [_rand(2, 3, 9, 8, seed=s) for s in range(3)]
    if layout == "transposed":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in base)
    elif layout == "sliced":
        q, k, v = (_rand(2, 3, 9, 16, seed=s)[..., ::2] for s in range(3))
    elif layout == "expanded":
        q, k, v = (t[:1].expand(2, -1, -1, -1) for t in base)
    else:
        q, k, v = (t.contiguous(memory_format=torch.channels_last) for t in base)
    _check(q, k, v)


def _bool_mask(*shape: int, seed: int = 3) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.4


MASKS = {
    "bool (L, S)": lambda: _bool_mask(5, 7),
    "bool per batch and head": lambda: _bool_mask(2, 3, 5, 7),
    "bool with empty rows": lambda: _bool_mask(5, 7).index_fill(0, torch.tensor([1, 3]), False),
    "float (L, S)": lambda: _rand(5, 7, seed=4),
    "float per batch": lambda: _rand(2, 1, 5, 7, seed=4),
    "float with -inf": lambda: _rand(5, 7, seed=4).masked_fill(_bool_mask(5, 7), float("-inf")),
    "causal upper left": lambda: causal_upper_left(5, 7),
    "causal lower right": lambda: causal_lower_right(5, 7),
}


@pytest.mark.parametrize("name", MASKS)
def test_masks(name: str) -> None:
    q, k, v = _rand(2, 3, 5, 8), _rand(2, 3, 7, 8, seed=1), _rand(2, 3, 7, 8, seed=2)
    _check(q, k, v, attn_mask=MASKS[name]())


def test_a_float_mask_gets_its_gradient() -> None:
    q, k, v = (_rand(2, 3, 5, 8, dtype=torch.float64, seed=s) for s in range(3))
    for backend in BACKENDS:
        bias = _rand(2, 1, 5, 5, dtype=torch.float64, seed=5).requires_grad_()
        mine = scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend)
        (got,) = torch.autograd.grad(mine.sum(), bias)
        bias2 = bias.detach().clone().requires_grad_()
        (want,) = torch.autograd.grad(TORCH_SDPA(q, k, v, attn_mask=bias2).sum(), bias2)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("scale", [None, 0.0, 0.05, 1.0, -0.7, 3.0])
def test_any_finite_scale(scale: float | None) -> None:
    q, k, v = (_rand(2, 3, 6, 8, seed=s) for s in range(3))
    _check(q, k, v, scale=scale)


@pytest.mark.parametrize("shape", [(2, 8, 5, 8), (1, 2, 2, 4, 5, 8)])
def test_grouped_query_attention(shape: tuple[int, ...]) -> None:
    q = _rand(*shape)
    kv_shape = (*shape[:-3], 2, 7, 8)
    _check(q, _rand(*kv_shape, seed=1), _rand(*kv_shape, seed=2), enable_gqa=True)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_dropout_scales_kept_weights_as_torch_does(backend: str) -> None:
    """Dropout zeroes weights with probability p and scales the rest by 1/(1 − p): the mean
    over many draws (here the rows of one batch, each drawing its own) is the output without
    dropout."""
    q, k, v = (_rand(1, 1, 4, 8, dtype=torch.float64, seed=s) for s in range(3))
    want = TORCH_SDPA(q, k, v)
    torch.manual_seed(0)
    n = 4000
    qn, kn, vn = (t.expand(n, -1, -1, -1) for t in (q, k, v))
    draws = scaled_dot_product_attention(qn, kn, vn, dropout_p=0.3, backend=backend)
    assert not torch.equal(draws[0], draws[1])
    torch.testing.assert_close(draws.mean(0, keepdim=True), want, atol=0.08, rtol=0)
    assert not scaled_dot_product_attention(q, k, v, dropout_p=1.0, backend=backend).any()


def test_sdpa_backend_draws_torch_s_own_dropout() -> None:
    q, k, v = (_rand(2, 2, 6, 8, seed=s) for s in range(3))
    torch.manual_seed(7)
    want = TORCH_SDPA(q, k, v, dropout_p=0.4)
    torch.manual_seed(7)
    got = scaled_dot_product_attention(q, k, v, dropout_p=0.4, backend="sdpa")
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"mask": True}, {"gqa": True}])
def test_backward_equals_torch_in_fp64(backend: str, kwargs: dict) -> None:
    q = _rand(2, 4, 6, 8, dtype=torch.float64).requires_grad_()
    heads = 2 if kwargs.get("gqa") else 4
    k = _rand(2, heads, 6, 8, dtype=torch.float64, seed=1).requires_grad_()
    v = _rand(2, heads, 6, 8, dtype=torch.float64, seed=2).requires_grad_()
    call = {"is_causal": kwargs.get("is_causal", False), "enable_gqa": bool(kwargs.get("gqa"))}
    if kwargs.get("mask"):
        call["attn_mask"] = _bool_mask(6, 6) | torch.eye(6, dtype=torch.bool)
    dout = _rand(2, 4, 6, 8, dtype=torch.float64, seed=9)
    mine = torch.autograd.grad(
        scaled_dot_product_attention(q, k, v, **call, backend=backend), (q, k, v), dout
    )
    want = torch.autograd.grad(TORCH_SDPA(q, k, v, **call), (q, k, v), dout)
    for got, w in zip(mine, want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-10, rtol=1e-10)


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 9),
    S=st.integers(1, 9),
    heads=st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]),
    masked=st.sampled_from(["none", "causal", "bool", "float"]),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_random_calls_equal_torch(L, S, heads, masked, backend, seed) -> None:
    Hq, Hk = heads
    q = _rand(2, Hq, L, 8, seed=seed)
    k, v = _rand(2, Hk, S, 8, seed=seed + 1), _rand(2, Hk, S, 8, seed=seed + 2)
    kwargs: dict = {"enable_gqa": Hk != Hq}
    if masked == "causal":
        kwargs["is_causal"] = True
    elif masked == "bool":
        kwargs["attn_mask"] = _bool_mask(L, S, seed=seed)
    elif masked == "float":
        kwargs["attn_mask"] = _rand(L, S, seed=seed + 3)
    _check(q, k, v, backends=(backend,), **kwargs)


# --- errors: the exception type torch raises, for the same mistake --------------------------


def _bad_calls() -> dict[str, tuple[tuple, dict]]:
    q = _rand(2, 4, 5, 8)
    return {
        "1-D inputs": ((_rand(8), _rand(8), _rand(8)), {}),
        "dtypes differ": ((q, q.double(), q), {}),
        "head dims differ": ((q, _rand(2, 4, 5, 7), q), {}),
        "heads do not broadcast": ((q, _rand(2, 3, 5, 8), _rand(2, 3, 5, 8)), {}),
        "GQA heads do not divide": (
            (q, _rand(2, 3, 5, 8), _rand(2, 3, 5, 8)),
            {"enable_gqa": True},
        ),
        "integer mask": ((q, q, q), {"attn_mask": torch.ones(5, 5, dtype=torch.long)}),
        "float64 mask for float32": ((q, q, q), {"attn_mask": torch.zeros(5, 5).double()}),
        "mask of the wrong shape": ((q, q, q), {"attn_mask": torch.ones(4, 5, dtype=torch.bool)}),
        "dropout above 1": ((q, q, q), {"dropout_p": 1.5}),
        "integer inputs": ((q.long(), q.long(), q.long()), {}),
        "a list for query": (([1.0], q, q), {}),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_errors_are_torch_s_types(name: str) -> None:
    args, kwargs = _bad_calls()[name]
    with pytest.raises(Exception) as theirs:
        TORCH_SDPA(*args, **kwargs)
    with pytest.raises(theirs.type) as mine:
        scaled_dot_product_attention(*args, **kwargs)
    if theirs.type is RuntimeError:  # a dikkat error is a ValueError too
        assert isinstance(mine.value, ValueError | TypeError), type(mine.value)


def test_what_torch_s_docs_refuse_is_refused_where_a_torch_kernel_lets_it_pass() -> None:
    """torch's docs: attn_mask with is_causal is an error, keys and values share their length;
    its fused CPU kernel takes both calls anyway (with E = Ev), its math kernel refuses them."""
    q = _rand(2, 4, 5, 8)
    with pytest.raises(
        SDPAArgumentError, match="Explicit attn_mask should not be set when is_causal=True"
    ):
        scaled_dot_product_attention(q, q, q, torch.ones(5, 5, dtype=torch.bool), is_causal=True)
    with pytest.raises(SDPAArgumentError):
        scaled_dot_product_attention(q, _rand(2, 4, 6, 8), q)


def test_a_non_finite_scale_is_refused_by_name() -> None:
    q = _rand(1, 1, 3, 4)
    with pytest.raises(SDPAArgumentError, match="scale must be a finite float"):
        scaled_dot_product_attention(q, q, q, scale=float("nan"))


def test_a_causal_bias_of_other_lengths_is_refused() -> None:
    q = _rand(1, 1, 3, 4)
    with pytest.raises(ValueError, match="CausalBias for 4 queries and 4 keys"):
        scaled_dot_product_attention(q, q, q, attn_mask=causal_upper_left(4, 4))


# --- the swap: torch.nn.functional's function replaced by the drop-in --------------------------


@pytest.fixture
def swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "scaled_dot_product_attention", scaled_dot_product_attention)


@pytest.mark.usefixtures("swapped")
def test_torch_s_modules_run_through_the_drop_in_without_recursion() -> None:
    """MultiheadAttention's python path calls F.scaled_dot_product_attention; dikkat's sdpa
    backend and CausalBias must not call back into the swapped function."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).train()  # the python path
    x = _rand(2, 5, 16)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    with dikkat.hf.recording():  # unrelated recorder: must not disturb the call
        got, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", TORCH_SDPA)
        want, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(got, want)
    q = _rand(1, 2, 4, 8)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=causal_lower_right(4, 4))
    torch.testing.assert_close(out, TORCH_SDPA(q, q, q, is_causal=True))


class _Block(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.usefixtures("swapped")
def test_torchscript_trace_and_script_of_a_module_calling_it() -> None:
    q, k, v = (_rand(1, 2, 4, 8, seed=s) for s in range(3))
    want = TORCH_SDPA(q, k, v, is_causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about python values
        traced = torch.jit.trace(_Block(), (q, k, v))
    torch.testing.assert_close(traced(q, k, v), want)
    scripted = torch.jit.script(_Block())
    torch.testing.assert_close(scripted(q, k, v), want)


# --- nested (jagged) tensors -----------------------------------------------------------------


def _jagged(lengths: list[int], H: int, D: int, seed: int) -> torch.Tensor:
    parts = [_rand(n, H * D, dtype=torch.float64, seed=seed + i) for i, n in enumerate(lengths)]
    nt = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    return nt.unflatten(-1, [H, D]).transpose(1, 2)  # (B, H, j, D)


@pytest.mark.parametrize("is_causal", [False, True])
def test_jagged_sequences_attend_only_to_themselves(is_causal: bool) -> None:
    lengths = [3, 6, 1]
    q, k, v = (_jagged(lengths, 2, 4, seed=10 * s) for s in range(3))
    out = scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert out.is_nested and out.shape[:2] == (3, 2)
    residual = q.transpose(1, 2).flatten(-2)  # (B, j, H·D): the output shares q's ragged dim
    assert (out.transpose(1, 2).flatten(-2) + residual).shape == residual.shape
    for got, qi, ki, vi in zip(out.unbind(), q.unbind(), k.unbind(), v.unbind(), strict=True):
        torch.testing.assert_close(got, TORCH_SDPA(qi, ki, vi, is_causal=is_causal))


def test_jagged_inputs_get_their_gradient() -> None:
    parts = [_rand(n, 8, dtype=torch.float64, seed=n).requires_grad_() for n in (2, 5)]
    q = torch.nested.as_nested_tensor(parts, layout=torch.jagged).unflatten(-1, [2, 4])
    q = q.transpose(1, 2)
    out = scaled_dot_product_attention(q, q, q)
    grads = torch.autograd.grad(out.values().square().sum(), parts)
    for part, grad in zip(parts, grads, strict=True):
        p = part.detach().requires_grad_()
        x = p.view(-1, 2, 4).transpose(0, 1)  # (H, L, D)
        (want,) = torch.autograd.grad(TORCH_SDPA(x, x, x).square().sum(), p)
        torch.testing.assert_close(grad, want)


def _outcome(call: Callable[[], torch.Tensor]) -> torch.Tensor | type[BaseException]:
    try:
        return call()
    except Exception as e:  # the type is what is compared
        return type(e)


@pytest.mark.parametrize("case", ["plain", "causal", "transposed", "mixed"])
def test_strided_nested_inputs_get_torchs_answer_or_torchs_error(case: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: the strided nested layout is a prototype
        nt = torch.nested.nested_tensor([_rand(2, 3, 4), _rand(2, 5, 4)])
    q = k = v = nt.transpose(1, 2) if case == "transposed" else nt
    if case == "mixed":
        k = v = _rand(2, 2, 5, 4)
    kwargs = {"is_causal": case == "causal"}
    want = _outcome(lambda: TORCH_SDPA(q, k, v, **kwargs))
    got = _outcome(lambda: scaled_dot_product_attention(q, k, v, **kwargs))
    if isinstance(want, type):
        assert isinstance(got, type) and issubclass(got, want), (got, want)
    else:
        assert isinstance(got, torch.Tensor) and got.is_nested
        for g, w in zip(got.unbind(), want.unbind(), strict=True):
            torch.testing.assert_close(g, w)


def test_nested_inputs_other_than_jagged_ones_are_refused_by_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strided = torch.nested.nested_tensor([_rand(2, 3, 4), _rand(2, 5, 4)])
    with pytest.raises(ValueError, match="cannot read strided nested tensors"):
        scaled_dot_product_attention(strided, strided, strided, backend="tiled")
    q = _jagged([2, 3], 1, 4, seed=0)
    with pytest.raises(ValueError, match="attn_mask cannot go with jagged"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"q is a nested tensor \(layout torch.jagged\)"):
        dikkat.attention(q, q, q)
