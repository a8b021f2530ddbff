"""Logit soft-capping (``softcap=``): the scaled scores s become c · tanh(s / c) before the bias
and the mask, as Gemma 2's attention does (docs/attention.md, "Soft-capping").

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.

The oracle is the formula written out below in float64; the reference and tiled backends
(forward and gradients, gradcheck too) and flex (forward, and its CPU backward, which is the tiled
backend's) are held to it. sdpa and linear refuse with a reason, so auto takes tiled (or the
reference where tiled cannot serve). ``test_softcap_tiled.py`` cuts the tiled backend's work
into many small tiles.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import Tensor

import dikkat
from dikkat import masks
from dikkat.core import clear_caches
from dikkat.core.masks import Mask

B, H, G, T, S, D, DV = 2, 4, 2, 6, 9, 16, 8
SCALE = 2.0  # large enough that the cap bends the scores (|s| reaches well past CAP)
CAP = 1.5
IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 2]])
MASKS: dict[str, Mask | Tensor | None] = {
    "none": None,
    "causal": masks.causal(),
    "sliding_window": masks.sliding_window(3),
    "document": masks.document(IDS),
    "padding": masks.padding(torch.tensor([0, 7])),  # sequence 0: every row empty
    "dense": torch.rand(2, 1, T, S, generator=torch.manual_seed(2)) < 0.6,
}
HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def formula(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor | None, softcap: float
) -> Tensor:
    """softmax(c · tanh(Q Kᵀ · scale / c) + bias, masked) V in float64; a row that sees no key
    gives 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = softcap * torch.tanh(q @ k.transpose(-2, -1) * SCALE / softcap)  # (B, H, T, S)
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, -math.inf)
    empty = ~allowed.any(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return p @ v


def inputs(seed: int = 0, bias: bool = True) -> dict[str, Tensor | None]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": randn(B, H, T, D),
        "k": randn(B, G, S, D),
        "v": randn(B, G, S, DV),
        "bias": randn(1, H, T, S) if bias else None,
        "dout": randn(B, H, T, DV),
    }


def allowed(mask: Mask | Tensor | None, q_offset: int) -> Tensor:
    full = (B, H, T, S)
    if mask is None:
        return torch.ones(full, dtype=torch.bool)
    return masks.as_mask(mask, q_offset).materialize(*full, q_offset).expand(full)


def _grads(out: Tensor, x: dict[str, Tensor | None]) -> list[Tensor]:
    wrt = [x[n] for n in ("q", "k", "v", "bias") if x[n] is not None]
    return [out.detach(), *torch.autograd.grad(out, wrt, x["dout"])]


def _leaves(x: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    return {n: None if t is None else t.clone().requires_grad_(n != "dout") for n, t in x.items()}


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("q_offset", [0, 3])
@pytest.mark.parametrize("mask_name", MASKS)
def test_forward_and_gradients_equal_the_fp64_formula(
    mask_name: str, q_offset: int, backend: str
) -> None:
    mask = MASKS[mask_name]
    x, y = _leaves(inputs()), _leaves(inputs())
    want = _grads(formula(y["q"], y["k"], y["v"], allowed(mask, q_offset), y["bias"], CAP), y)
    out = dikkat.attention(
        x["q"], x["k"], x["v"], mask, scale=SCALE, softcap=CAP, bias=x["bias"],
        q_offset=q_offset, backend=backend,
    )  # fmt: skip
    got = _grads(out, x)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12, msg=name)
    # the cap changed the answer: the uncapped call differs
    with torch.no_grad():
        plain = dikkat.attention(
            x["q"], x["k"], x["v"], mask, scale=SCALE, bias=x["bias"], q_offset=q_offset
        )
    if bool(allowed(mask, q_offset).any()):
        assert float((plain - got[0]).abs().max()) > 1e-3


def test_weights_and_lse_are_those_of_the_capped_scores() -> None:
    x = inputs(seed=1)
    q, k, v, bias = x["q"], x["k"], x["v"], x["bias"]
    mask = masks.causal()
    _, (weights, lse) = dikkat.attention(
        q, k, v, mask, scale=SCALE, softcap=CAP, bias=bias, q_offset=3,
        return_weights=True, return_lse=True,
    )  # fmt: skip
    group = H // G
    s = CAP * torch.tanh(q @ k.repeat_interleave(group, 1).transpose(-2, -1) * SCALE / CAP) + bias
    s = s.masked_fill(~allowed(mask, 3), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(weights, torch.exp(s - lse[..., None]), atol=1e-12, rtol=1e-12)
    # and dikkat.attention_weights recomputes chosen rows of them from the lse
    rows, heads = [0, 2, 5], [1, 3]
    part = dikkat.attention_weights(
        q, k, lse, rows=rows, heads=heads, mask=mask, scale=SCALE, bias=bias, q_offset=3,
        softcap=CAP,
    )  # fmt: skip
    torch.testing.assert_close(part, weights[:, heads][:, :, rows], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_gradcheck(backend: str) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    bias = torch.randn(1, 2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        return dikkat.attention(
            q, k, v, masks.causal(), scale=SCALE, softcap=0.7, bias=bias, backend=backend
        )

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


@pytest.mark.skipif(not HAS_FLEX, reason="torch has no flex_attention")
@pytest.mark.parametrize("q_offset", [0, 3])
@pytest.mark.parametrize("mask_name", MASKS)
def test_flex_forward_equals_the_fp64_formula(mask_name: str, q_offset: int) -> None:
    """Short calls run flex eagerly (its score_mod composes the cap and the bias)."""
    mask = MASKS[mask_name]
    x = inputs(seed=5)
    want = formula(x["q"], x["k"], x["v"], allowed(mask, q_offset), x["bias"], CAP)
    got = dikkat.attention(
        x["q"], x["k"], x["v"], mask, scale=SCALE, softcap=CAP, bias=x["bias"],
        q_offset=q_offset, backend="flex",
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    without_bias = dikkat.attention(
        x["q"], x["k"], x["v"], mask, scale=SCALE, softcap=CAP, q_offset=q_offset,
        backend="flex",
    )  # fmt: skip
    want = formula(x["q"], x["k"], x["v"], allowed(mask, q_offset), None, CAP)
    torch.testing.assert_close(without_bias, want, atol=1e-12, rtol=1e-12)


@pytest.mark.skipif(not HAS_FLEX, reason="torch has no flex_attention")
def test_a_compiled_flex_kernel_soft_caps() -> None:
    # One compile (tens of seconds on a small CPU): past flex_eager_max_cells, GQA, a window.
    clear_caches()
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 1024, 16, generator=g)
    k, v = (torch.randn(1, 1, 1024, 16, generator=g) for _ in range(2))
    mask = masks.sliding_window(64)
    out = dikkat.attention(q, k, v, mask, scale=1.0, softcap=2.0, backend="flex")
    want = dikkat.attention(
        q.double(), k.double(), v.double(), mask, scale=1.0, softcap=2.0, backend="reference"
    )
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    plain = dikkat.attention(q.double(), k.double(), v.double(), mask, scale=1.0)
    assert float((plain - want).abs().max()) > 1e-2
    clear_caches()


@pytest.mark.skipif(not HAS_FLEX, reason="torch has no flex_attention")
@pytest.mark.parametrize("mask_name", ["causal", "sliding_window", "padding"])
def test_flex_gradients_on_cpu_equal_the_fp64_formula(mask_name: str) -> None:
    """On CPU flex has no backward: its gradients are the tiled backend's, soft-capped too, and
    so are those of a bias on any device."""
    mask = MASKS[mask_name]
    x, y = _leaves(inputs(seed=8)), _leaves(inputs(seed=8))
    want = _grads(formula(y["q"], y["k"], y["v"], allowed(mask, 3), y["bias"], CAP), y)
    out = dikkat.attention(
        x["q"], x["k"], x["v"], mask, scale=SCALE, softcap=CAP, bias=x["bias"], q_offset=3,
        backend="flex",
    )  # fmt: skip
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), _grads(out, x), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12, msg=name)


@pytest.mark.parametrize("backend", ["sdpa", "linear"])
def test_backends_that_cannot_soft_cap_refuse_with_the_reason(backend: str) -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    mask = masks.causal() if backend == "linear" else None
    with pytest.raises(
        ValueError, match=rf"'{backend}' cannot serve this call: it cannot soft-cap the scores"
    ):
        dikkat.attention(q, k, v, mask, softcap=CAP, backend=backend)


def test_auto_takes_a_backend_that_can_and_explain_says_why() -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    text = dikkat.explain(q, k, v, masks.causal(), softcap=CAP)
    assert text.startswith("tiled (")
    assert "not sdpa: it cannot soft-cap the scores" in text
    assert "not flex: it cannot soft-cap" not in text
    assert dikkat.explain(q, k, v, masks.causal()).startswith("sdpa (the first choice)")
    torch.testing.assert_close(
        dikkat.attention(q, k, v, masks.causal(), softcap=CAP),
        dikkat.attention(q, k, v, masks.causal(), softcap=CAP, backend="reference"),
    )
    # where tiled cannot serve (the weights, dropout), auto takes the reference
    weights = dikkat.explain(q, k, v, masks.causal(), softcap=CAP, return_weights=True)
    assert weights.startswith("reference (")
    assert "not tiled: it never holds the full weights" in weights


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_softcap_that_is_not_positive_and_finite_raises(bad: float) -> None:
    q = k = v = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="softcap must be positive and finite"):
        dikkat.attention(q, k, v, softcap=bad)
    with pytest.raises(ValueError, match="softcap must be positive and finite"):
        dikkat.explain(q, k, v, softcap=bad)


@pytest.mark.parametrize("bad", ["1.0", True, torch.tensor(1.0)])
def test_a_softcap_that_is_not_a_number_raises(bad: object) -> None:
    q = k = v = torch.randn(1, 1, 2, 4)
    with pytest.raises(TypeError, match="softcap must be a float or None"):
        dikkat.attention(q, k, v, softcap=bad)  # type: ignore[arg-type]


def test_the_nan_rule_holds_with_softcap() -> None:
    """tanh bounds an infinite score, but the rule of dikkat.attention still makes the rows that
    reach a non-finite input NaN, and leaves every other row as it would be."""
    x = inputs(seed=7, bias=False)
    q, k, v = x["q"].clone(), x["k"].clone(), x["v"].clone()
    mask = masks.causal()
    clean = dikkat.attention(q, k, v, mask, scale=SCALE, softcap=CAP)
    k[:, :, 5] = math.nan  # key 5: under causal, seen by rows 5.. only
    q[1, 0, 2] = math.inf  # one query
    got = dikkat.attention(q, k, v, mask, scale=SCALE, softcap=CAP)
    reached = torch.zeros(B, H, T, dtype=torch.bool)
    reached[:, :, 5:] = True
    reached[1, 0, 2] = True
    assert got[reached].isnan().all()
    torch.testing.assert_close(got[~reached], clean[~reached], atol=1e-12, rtol=1e-12)
