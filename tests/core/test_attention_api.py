"""What ``dikkat.attention`` returns: ``out`` with no extra asked for, ``(out, AttentionAux)``
with one (docs/attention.md, "What attention returns"), the same for every backend that serves
the call, and the numbers those extras hold against the fp64 formula.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` query length, ``S`` key
length, ``D`` head dim.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import dikkat
from dikkat.core import AttentionAux, attention, available_backends, explain, masks
from helpers import cpu_backends

B, H, G, T, S, D = 2, 4, 2, 5, 7, 8
Q_OFFSET = S - T  # the queries are the last keys (causal linear attention needs it)
FLAGS = [(True, False), (False, True), (True, True)]  # (return_weights, return_lse)
# the backends that must serve a flag on any device (a call asking for both: those that serve
# both); others may decline (sdpa holds neither extra, flex on CPU has no lse)
MUST_SERVE = {"return_weights": {"reference", "auto"}, "return_lse": {"reference", "auto", "tiled"}}


def _inputs() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(*shape, generator=g, dtype=torch.float64)
        for shape in ((B, H, T, D), (B, G, S, D), (B, G, S, D))
    )  # type: ignore[return-value]


def _formula(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Causal softmax attention in fp64, written out: (out, weights, lse)."""
    k, v = (t.repeat_interleave(H // G, dim=1) for t in (k, v))  # (B, H, S, D)
    scores = (q @ k.transpose(-2, -1)) * D**-0.5  # (B, H, T, S)
    i = torch.arange(T).unsqueeze(-1) + Q_OFFSET
    j = torch.arange(S)
    scores = scores.masked_fill(j > i, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights, torch.logsumexp(scores, dim=-1)


def _call(backend: str, **flags: bool):
    q, k, v = _inputs()
    return attention(q, k, v, masks.causal(), q_offset=Q_OFFSET, backend=backend, **flags)


@pytest.mark.parametrize("backend", ["auto", *cpu_backends()])
def test_no_flag_gives_a_tensor(backend: str) -> None:
    out = _call(backend)
    assert type(out) is Tensor and out.shape == (B, H, T, D)
    if backend == "auto" or backend in cpu_backends(exact_only=True):
        torch.testing.assert_close(out, _formula(*_inputs())[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(("return_weights", "return_lse"), FLAGS)
@pytest.mark.parametrize("backend", ["auto", *available_backends()])
def test_an_extra_gives_out_and_aux(backend: str, return_weights: bool, return_lse: bool) -> None:
    asked = {"return_weights": return_weights, "return_lse": return_lse}
    try:
        result = _call(backend, **asked)
    except ValueError as e:
        must = all(backend in MUST_SERVE[flag] for flag, on in asked.items() if on)
        if must or "cannot serve this call" not in str(e):
            raise
        pytest.skip(f"{backend} declines: {e}")
    want_out, want_weights, want_lse = _formula(*_inputs())
    assert type(result) is tuple and len(result) == 2
    out, aux = result
    assert isinstance(aux, AttentionAux)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    if return_weights:
        assert aux.weights is not None and aux.weights.shape == (B, H, T, S)
        torch.testing.assert_close(aux.weights, want_weights, atol=1e-12, rtol=1e-12)
    else:
        assert aux.weights is None
    if return_lse:
        assert aux.lse is not None and aux.lse.shape == (B, H, T)
        torch.testing.assert_close(aux.lse, want_lse, atol=1e-12, rtol=1e-12)
    else:
        assert aux.lse is None


def test_aux_unpacks_and_names_its_fields() -> None:
    out, (weights, lse) = _call("reference", return_weights=True, return_lse=True)
    again, aux = _call("reference", return_weights=True, return_lse=True)
    assert torch.equal(out, again)
    assert torch.equal(weights, aux.weights) and torch.equal(lse, aux.lse)
    assert aux._fields == ("weights", "lse")
    assert dikkat.AttentionAux is AttentionAux


def test_reference_attention_always_returns_its_weights() -> None:
    q, k, v = _inputs()
    want_out, want_weights, want_lse = _formula(q, k, v)
    kwargs = {"scale": D**-0.5, "q_offset": Q_OFFSET}
    out, aux = dikkat.reference_attention(q, k, v, masks.causal(), **kwargs)
    assert isinstance(aux, AttentionAux) and aux.lse is None
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(aux.weights, want_weights, atol=1e-12, rtol=1e-12)
    _, aux = dikkat.reference_attention(q, k, v, masks.causal(), return_lse=True, **kwargs)
    torch.testing.assert_close(aux.lse, want_lse, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("flag", ["return_weights", "return_lse"])
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(flag: str, value: object) -> None:
    q, k, v = _inputs()
    got = type(value).__name__
    with pytest.raises(TypeError, match=rf"{flag} must be True or False, got {got}"):
        attention(q, k, v, **{flag: value})  # type: ignore[arg-type]


def test_explain_refuses_a_flag_that_is_not_a_bool() -> None:
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="return_weights must be True or False, got int"):
        explain(q, k, v, return_weights=1)  # type: ignore[arg-type]
