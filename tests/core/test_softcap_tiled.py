"""The tiled backend with soft-capping (``softcap=``): c · tanh(s / c) on each tile's scaled
scores, before the mask and the bias (docs/attention.md, "Soft-capping").

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.

The oracle is dikkat's reference backend on float64 inputs; the tiled calls run in float32 (and
in float64 under hypothesis), with tiles small enough that the online softmax merges several key
tiles per row, masked tiles are skipped and windows are gathered. The fused CPU kernel takes no
score modifier, so a soft-capped ``fused=True`` call is refused and ``fused=None`` runs plain ops.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import dikkat
from dikkat import masks
from dikkat.core import tiled
from dikkat.core.masks import Mask, as_mask
from helpers import Case, attention_cases

B, H, G, T, S, D = 2, 4, 2, 7, 11, 8  # Dv = D: where the fused kernel could run, but for the cap
SCALE, CAP = 2.0, 1.5  # the scores reach well past the cap
IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2]])
SINK = masks.padding(torch.tensor([1, 1])) | masks.sliding_window(2)  # key 0 and a window
MASKS: dict[str, Mask | Tensor | None] = {
    "none": None,
    "causal": masks.causal(),
    "sliding_window": masks.sliding_window(3),
    "document": masks.document(IDS),
    "padding": masks.padding(torch.tensor([0, 9])),  # sequence 0: no row sees a key
    "sink": SINK,
    "dense": torch.rand(B, 1, T, S, generator=torch.manual_seed(3)) < 0.5,  # at any q_offset
}
# (q_offset, windows): T ≠ S with the queries top-left (0) or the last T of the S keys (S − T);
# windows=True gathers one key window per block (no bias then), False cuts rows into key tiles
PLANS = {"rows@0": (0, False), "rows@4": (S - T, False), "windows@4": (S - T, True)}
TILES = {"block": 2, "key_tile": 3, "cells": 40}  # several blocks and key tiles per call


def inputs(seed: int, bias: bool) -> dict[str, Tensor | None]:
    """q, k, v, bias and an upstream gradient, float64."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": randn(B, H, T, D),
        "k": randn(B, G, S, D),
        "v": randn(B, G, S, D),
        "bias": randn(1, H, T, S) if bias else None,
        "dout": randn(B, H, T, D),
    }


def grads_of(
    x: dict[str, Tensor | None], dtype: torch.dtype, call
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(out, lse, [dq, dk, dv(, dbias)]) of ``call(q, k, v, bias)`` on x cast to ``dtype``."""
    names = [n for n in ("q", "k", "v", "bias") if x[n] is not None]
    leaves = {n: x[n].to(dtype).requires_grad_() for n in names}
    out, lse = call(leaves["q"], leaves["k"], leaves["v"], leaves.get("bias"))
    grads = torch.autograd.grad(out, [leaves[n] for n in names], x["dout"].to(dtype))
    return out.detach(), lse, list(grads)


def reference(mask: Mask | None, q_offset: int, softcap: float | None = CAP):
    def call(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        out, (_, lse) = dikkat.attention(
            q, k, v, mask, scale=SCALE, softcap=softcap, bias=bias, q_offset=q_offset,
            backend="reference", return_lse=True,
        )  # fmt: skip
        return out, lse

    return call


def tiled_call(mask: Mask | None, q_offset: int, **kwargs):
    def call(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        return tiled.tiled_attention(
            q, k, v, mask, scale=SCALE, softcap=CAP, bias=bias, q_offset=q_offset, **kwargs
        )

    return call


def assert_all_close(got, want, atol: float) -> None:
    (out, lse, grads), (w_out, w_lse, w_grads) = got, want
    torch.testing.assert_close(out.double(), w_out, atol=atol, rtol=atol, msg="out")
    # −inf where a row sees no key, in both
    torch.testing.assert_close(lse.double(), w_lse, atol=atol, rtol=atol, msg="lse")
    names = ("dq", "dk", "dv", "dbias")[: len(w_grads)]
    for name, g, w in zip(names, grads, w_grads, strict=True):
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=atol, msg=name)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("mask_name", MASKS)
def test_fp32_tiles_equal_the_fp64_reference(mask_name: str, plan: str) -> None:
    """Output, lse and the gradients of q, k, v and the bias (rows plans: the bias forces one),
    grouped-query heads, T ≠ S at both alignments, rows that see no key."""
    q_offset, windows = PLANS[plan]
    mask = MASKS[mask_name]
    mask = None if mask is None else as_mask(mask, q_offset)
    x = inputs(seed=len(mask_name), bias=not windows)
    want = grads_of(x, torch.float64, reference(mask, q_offset))
    call = tiled_call(mask, q_offset, windows=windows, **TILES)
    got = grads_of(x, torch.float32, call)
    assert_all_close(got, want, atol=1e-5)
    summary = tiled.plan_summary(x["q"], x["k"], mask, q_offset=q_offset, windows=windows, **TILES)
    assert summary.kind == ("windows" if windows and mask is not None else "rows")
    if mask_name == "padding":  # no row of sequence 0 sees a key: out 0, lse −inf, no gradient
        assert bool((got[0][0] == 0).all()) and bool(torch.isneginf(got[1][0]).all())
        assert bool((got[2][0][0] == 0).all())


def test_small_tiles_skip_what_the_mask_hides_and_the_cap_is_applied() -> None:
    x = inputs(seed=11, bias=True)
    mask = SINK  # between key 0 and the window, whole key tiles are hidden
    summary = tiled.plan_summary(x["q"], x["k"], mask, bias=x["bias"], q_offset=S - T, **TILES)
    assert summary.kind == "rows" and summary.skipped_tiles > 0
    want = grads_of(x, torch.float64, reference(mask, S - T))
    got = grads_of(x, torch.float32, tiled_call(mask, S - T, **TILES))
    assert_all_close(got, want, atol=1e-5)
    # the cap bends these scores: without it the reference gives another answer
    plain = grads_of(x, torch.float64, reference(mask, S - T, softcap=None))
    assert float((plain[0] - got[0].double()).abs().max()) > 1e-2
    assert float((plain[2][0] - got[2][0].double()).abs().max()) > 1e-2


def test_the_fused_kernel_is_refused_and_none_runs_plain_ops() -> None:
    x = inputs(seed=12, bias=False)
    q, k, v = (x[n].float() for n in "qkv")
    mask = masks.causal()
    with pytest.raises(ValueError, match=r"fused=True, but .*: softcap is set"):
        tiled.tiled_attention(q, k, v, mask, scale=SCALE, softcap=CAP, fused=True)
    # without the cap this same call does run fused
    tiled.tiled_attention(q, k, v, mask, scale=SCALE, fused=True, **TILES)
    auto = grads_of(x, torch.float32, tiled_call(mask, 0, fused=None, **TILES))
    plain = grads_of(x, torch.float32, tiled_call(mask, 0, fused=False, **TILES))
    for a, p in zip((auto[0], auto[1], *auto[2]), (plain[0], plain[1], *plain[2]), strict=True):
        assert torch.equal(a, p)
    assert_all_close(auto, grads_of(x, torch.float64, reference(mask, 0)), atol=1e-5)


def test_the_tiled_backend_of_dikkat_attention_soft_caps() -> None:
    x = inputs(seed=13, bias=True)
    mask = masks.causal()

    def call(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        out, (_, lse) = dikkat.attention(
            q, k, v, mask, scale=SCALE, softcap=CAP, bias=bias, q_offset=S - T,
            backend="tiled", return_lse=True,
        )  # fmt: skip
        return out, lse

    want = grads_of(x, torch.float64, reference(mask, S - T))
    assert_all_close(grads_of(x, torch.float32, call), want, atol=1e-5)


@pytest.mark.parametrize("bad", [0.0, -2.0, math.inf])
def test_a_bad_softcap_raises_in_tiled_attention(bad: float) -> None:
    q = k = v = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="softcap must be positive and finite"):
        tiled.tiled_attention(q, k, v, scale=1.0, softcap=bad)


@settings(max_examples=25)
@given(
    case=attention_cases(max_len=20),
    softcap=st.sampled_from([0.3, 1.0, 5.0]),
    block=st.sampled_from([1, 3, 8]),
    key_tile=st.sampled_from([1, 4, 4096]),
    windows=st.sampled_from([None, False, True]),
)
def test_any_call_in_any_tiles_equals_the_fp64_reference(
    case: Case, softcap: float, block: int, key_tile: int, windows: bool | None
) -> None:
    """Every mask kind, bias layout and head grouping, cut any way, in float64."""
    x = case.inputs()
    mask = None if case.mask is None else as_mask(case.mask, case.q_offset)
    scale = 1.5 / math.sqrt(case.D)
    names = [n for n in ("q", "k", "v", "bias") if x[n] is not None]

    def run(backend: str) -> list[Tensor]:
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        out, (_, lse) = dikkat.attention(
            leaves["q"], leaves["k"], leaves["v"], mask, scale=scale, softcap=softcap,
            bias=leaves.get("bias"), q_offset=case.q_offset, backend=backend, return_lse=True,
        )  # fmt: skip
        grads = torch.autograd.grad(out, [leaves[n] for n in names], x["dout"])
        return [out.detach(), lse, *grads]

    def run_tiled() -> list[Tensor]:
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        out, lse = tiled.tiled_attention(
            leaves["q"], leaves["k"], leaves["v"], mask, scale=scale, softcap=softcap,
            bias=leaves.get("bias"), q_offset=case.q_offset, block=block, key_tile=key_tile,
            windows=windows,
        )  # fmt: skip
        grads = torch.autograd.grad(out, [leaves[n] for n in names], x["dout"])
        return [out.detach(), lse, *grads]

    for name, got, want in zip(["out", "lse", *names], run_tiled(), run("reference"), strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=name)
