"""Attention sinks (``sinks=``): one more logit per row in the softmax's denominator, with no
value, as gpt-oss learns one per head (docs/attention.md, "Attention sinks").

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.

The oracle is eager softmax with an extra column written out below in float64: the scores, the
sink appended as column S, the softmax over S + 1 columns, the last dropped. The reference and
tiled backends are held to it forward and backward (q, k, v and the sinks; gradcheck of the
sinks), with masks — a row that sees no key puts all its weight on the sink — grouped-query
heads and sinks per head or per head and query. Every other backend refuses them by name.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch import Tensor

import dikkat
from dikkat import masks
from dikkat.core import Backend, tiled
from dikkat.core.masks import Mask, as_mask

B, H, G, T, S, D, DV = 2, 4, 2, 6, 9, 8, 5
SCALE = 0.7
IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 2]])
MASKS: dict[str, Mask | Tensor | None] = {
    "none": None,
    "causal": masks.causal(),
    "sliding_window": masks.sliding_window(3),
    "document": masks.document(IDS),
    "padding": masks.padding(torch.tensor([0, 7])),  # sequence 0: every row sees no key
    "dense": torch.rand(2, 1, T, S, generator=torch.manual_seed(2)) < 0.6,
}
# the sinks' layouts: one per head (gpt-oss's), one per head and query, and a broadcast one
SINK_SHAPES = {"per_head": (H,), "per_row": (B, H, T), "per_head_3d": (1, H, 1)}


def formula(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, sinks: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, weights, lse) of softmax([Q Kᵀ · scale, masked | sink]) with the sink's column
    dropped before V, in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-2, -1) * SCALE).masked_fill(~allowed, -math.inf)  # (B, H, T, S)
    sink = (sinks.view(1, -1, 1) if sinks.dim() == 1 else sinks).expand(B, H, T)
    with_sink = torch.cat([s, sink.unsqueeze(-1)], dim=-1)  # (B, H, T, S + 1)
    p = torch.softmax(with_sink, dim=-1)[..., :S]
    return p @ v, p, torch.logsumexp(with_sink, dim=-1)


def inputs(seed: int = 0, sink_shape: tuple[int, ...] = (H,), dv: int = DV) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": randn(B, H, T, D),
        "k": randn(B, G, S, D),
        "v": randn(B, G, S, dv),
        "sinks": 2.0 * randn(*sink_shape),  # wide: some sinks dominate their rows, some vanish
        "dout": randn(B, H, T, dv),
    }


def allowed(mask: Mask | Tensor | None, q_offset: int) -> Tensor:
    full = (B, H, T, S)
    if mask is None:
        return torch.ones(full, dtype=torch.bool)
    return as_mask(mask, q_offset).materialize(*full, q_offset).expand(full)


def _leaves(x: dict[str, Tensor], dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    return {n: t.to(dtype).requires_grad_(n != "dout") for n, t in x.items()}


def _grads(out: Tensor, x: dict[str, Tensor]) -> list[Tensor]:
    wrt = [x[n] for n in ("q", "k", "v", "sinks")]
    return [out.detach(), *torch.autograd.grad(out, wrt, x["dout"].to(out.dtype))]


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("sink_shape", SINK_SHAPES)
@pytest.mark.parametrize("q_offset", [0, 3])
@pytest.mark.parametrize("mask_name", MASKS)
def test_forward_and_gradients_equal_the_fp64_formula(
    mask_name: str, q_offset: int, sink_shape: str, backend: str
) -> None:
    mask = MASKS[mask_name]
    x, y = _leaves(inputs(1, SINK_SHAPES[sink_shape])), _leaves(inputs(1, SINK_SHAPES[sink_shape]))
    want = _grads(formula(y["q"], y["k"], y["v"], allowed(mask, q_offset), y["sinks"])[0], y)
    out = dikkat.attention(
        x["q"], x["k"], x["v"], mask, scale=SCALE, sinks=x["sinks"], q_offset=q_offset,
        backend=backend,
    )  # fmt: skip
    got = _grads(out, x)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12, msg=name)
    assert float(want[4].abs().max()) > 1e-3  # the sinks' gradient is not trivially 0
    with torch.no_grad():  # and the sinks changed the answer
        plain = dikkat.attention(x["q"], x["k"], x["v"], mask, scale=SCALE, q_offset=q_offset)
    if bool(allowed(mask, q_offset).any()):
        assert float((plain - got[0]).abs().max()) > 1e-3


def test_weights_lse_and_rows_that_see_no_key() -> None:
    """The weights sum to 1 − exp(sink − lse) < 1; a row with no allowed key puts all its weight
    on the sink: output 0, weights 0, lse = sink. tiled's lse is the reference's, and
    dikkat.attention_weights recomputes the weights from it, or from the scores and the sinks."""
    x = inputs(seed=2)
    q, k, v, sinks = x["q"], x["k"], x["v"], x["sinks"]
    mask = MASKS["padding"]
    want_out, want_w, want_lse = formula(q, k, v, allowed(mask, 0), sinks)
    out, (weights, lse) = dikkat.attention(
        q, k, v, mask, scale=SCALE, sinks=sinks, return_weights=True, return_lse=True
    )
    for g, w in ((out, want_out), (weights, want_w), (lse, want_lse)):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
    total = weights.sum(-1)
    torch.testing.assert_close(total, 1 - torch.exp(sinks.view(1, H, 1) - lse))
    assert bool((total[1] < 1).all()) and float(total[1].min()) < 0.9
    assert bool((out[0] == 0).all()) and bool((weights[0] == 0).all())  # sequence 0 sees no key
    torch.testing.assert_close(lse[0], sinks.view(H, 1).expand(H, T))
    _, (_, tiled_lse) = dikkat.attention(
        q, k, v, mask, scale=SCALE, sinks=sinks, backend="tiled", return_lse=True
    )
    torch.testing.assert_close(tiled_lse, lse, atol=1e-12, rtol=1e-12)
    rows, heads = [0, 4], [1, 2]
    for given in (tiled_lse, None):
        part = dikkat.attention_weights(
            q, k, given, rows=rows, heads=heads, mask=mask, scale=SCALE, sinks=sinks
        )
        torch.testing.assert_close(part, weights[:, heads][:, :, rows], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("plan", ["rows", "windows"])
def test_fp32_tiles_equal_the_fp64_formula(plan: str, fused: bool) -> None:
    """Many small tiles in float32 — rows of key tiles or gathered windows, PyTorch's fused CPU
    kernel or plain ops (D = Dv) — join the sink after the last tile; a row that sees no key
    gets lse = sink and no gradient."""
    q_offset, mask = S - T, masks.sliding_window(3) & masks.padding(torch.tensor([2, 9]))
    x = inputs(seed=3, sink_shape=(B, H, T), dv=D)  # the fused kernel takes one head dim
    y, f = _leaves(x), _leaves(x, torch.float32)
    want_out, _, want_lse = formula(y["q"], y["k"], y["v"], allowed(mask, q_offset), y["sinks"])
    want = _grads(want_out, y)
    windows, tiles = plan == "windows", {"block": 2, "key_tile": 3, "cells": 40}
    out, lse = tiled.tiled_attention(
        f["q"], f["k"], f["v"], mask, scale=SCALE, q_offset=q_offset, sinks=f["sinks"],
        windows=windows, fused=fused, **tiles,
    )  # fmt: skip
    got = _grads(out, f)
    torch.testing.assert_close(lse.double(), want_lse.detach(), atol=1e-5, rtol=1e-5)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5, msg=name)
    summary = tiled.plan_summary(f["q"], f["k"], mask, q_offset=q_offset, windows=windows, **tiles)
    assert summary.kind == plan and summary.tiles > 2
    unseen = ~allowed(mask, q_offset).any(-1)  # (B, H, T): rows that see no key
    assert bool(unseen.any())
    assert bool((got[0][unseen] == 0).all()) and bool((got[1][unseen] == 0).all())


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_gradcheck(backend: str) -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(1, 1, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    sinks = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    mask = masks.causal()  # query 0 (q_offset −1) sees no key: all its weight on the sink

    def f(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor) -> Tensor:
        return dikkat.attention(q, k, v, mask, sinks=sinks, q_offset=-1, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_a_nan_query_poisons_its_row_only() -> None:
    """The NaN rule holds with sinks: the row that reaches the NaN is NaN, the others are as
    they were."""
    x = inputs(seed=5)
    q = x["q"].clone()
    q[1, 2, 3, 0] = float("nan")
    clean = dikkat.attention(x["q"], x["k"], x["v"], sinks=x["sinks"], backend="tiled")
    out = dikkat.attention(q, x["k"], x["v"], sinks=x["sinks"], backend="tiled")
    bad = torch.zeros(B, H, T, dtype=torch.bool)
    bad[1, 2, 3] = True
    assert bool(out[bad].isnan().all())
    torch.testing.assert_close(out[~bad], clean[~bad], atol=1e-12, rtol=1e-12)


def test_backends_without_sinks_refuse_them_by_name_and_auto_passes_them_by() -> None:
    x = inputs(seed=6)
    q, k, v, sinks = x["q"], x["k"], x["v"], x["sinks"]
    honour = {"reference", "tiled"}
    others = [b for b in dikkat.available_backends() if b not in honour]
    assert {"sdpa", "flex", "linear"} <= set(others)
    for backend in others:
        with pytest.raises(ValueError, match=r"cannot add attention sinks \(sinks=\)"):
            dikkat.attention(q, k, v, sinks=sinks, backend=backend)
    why = dikkat.explain(q, k, v, sinks=sinks)
    assert why.startswith("tiled ") and "not sdpa: it cannot add attention sinks" in why
    assert dikkat.explain(q, k, v, sinks=sinks, return_weights=True).startswith("reference ")


def test_a_registered_backend_that_does_not_declare_sinks_never_receives_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend whose own supports() says yes to anything is still refused: Backend.sinks
    defaults to False, so a backend written before sinks existed cannot drop them unawares."""
    runs: list[object] = []

    def run(r: object) -> tuple[Tensor, None, None]:
        runs.append(r)
        return torch.zeros(B, H, T, DV, dtype=torch.float64), None, None

    backend = Backend("sinkless", run, lambda r: None, "serves anything")
    assert backend.sinks is False
    registry = importlib.import_module("dikkat.core.attention")._BACKENDS
    monkeypatch.setitem(registry, "sinkless", backend)  # removed again after the test
    x = inputs(seed=7)
    with pytest.raises(ValueError, match="'sinkless' cannot serve this call: it cannot add"):
        dikkat.attention(x["q"], x["k"], x["v"], sinks=x["sinks"], backend="sinkless")
    assert runs == []


@pytest.mark.parametrize(
    ("sinks", "error", "message"),
    [
        (torch.zeros(H + 1), ValueError, r"sinks must have shape \(H,\) = \(4,\)"),
        (torch.zeros(B, H), ValueError, "or 3 dims broadcastable to"),
        (torch.zeros(B, H, T + 1), ValueError, r"\(B, H, T\) = \(2, 4, 6\), got \(2, 4, 7\)"),
        (torch.zeros(H, dtype=torch.long), TypeError, "sinks must be a float tensor"),
        ([0.0] * H, TypeError, "sinks must be a tensor or None, got list"),
        (torch.tensor([0.0, float("nan"), 1.0, float("inf")]), ValueError, "2 of the 4 entries"),
    ],
)
def test_bad_sinks_are_refused_by_name(sinks: object, error: type, message: str) -> None:
    x = inputs()
    for call in (dikkat.attention, dikkat.explain):
        with pytest.raises(error, match=message):
            call(x["q"], x["k"], x["v"], sinks=sinks)  # type: ignore[operator]
    with pytest.raises(error, match=message):
        tiled.tiled_attention(x["q"], x["k"], x["v"], scale=SCALE, sinks=sinks)  # type: ignore[arg-type]
