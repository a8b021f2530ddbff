"""``tiled_backward``: one block of keys' share of the gradients, given the final output and
log-sum-exp of attention over all the keys.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.

The keys are split into two blocks; each block's gradients, computed from the fp64 reference's
output and log-sum-exp on all the keys, must add up to autograd through that reference. The
second block's keys start at ``SPLIT``: for a mask of q − k (causal, a sliding window) that is
the same mask with ``q_offset − SPLIT``, for a bool tensor its columns from ``SPLIT``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import dikkat
from dikkat import masks
from dikkat.core.tiled import tiled_backward

B, H, G, T, S, D = 2, 4, 2, 12, 20, 8
SPLIT = 9  # block 1: keys 0 … 8, block 2: keys 9 … 19
OFFSET = S - T  # the queries are the last T of the S positions
SCALE = 1 / math.sqrt(D)
DENSE = torch.rand(B, 1, T, S, generator=torch.manual_seed(5)) < 0.4
DENSE[0, 0, 3] = False  # a row that sees no key at all: lse −inf, gradient 0
MASKS = {
    "none": (None, 0),
    "causal": (masks.causal(), OFFSET),
    "sliding_window(4)": (masks.sliding_window(4), OFFSET),
    "causal, queries first": (masks.causal(), 0),  # block 2 hidden from most rows
    "dense": (DENSE, 0),
}
TILINGS = {"default": {}, "small tiles": {"block": 2, "key_tile": 3, "cells": 40}}


def tensors(dv: int, kv_batch: int = B) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(dv * 10 + kv_batch)
    return (
        torch.randn(B, H, T, D, generator=g, dtype=torch.float64),
        torch.randn(kv_batch, G, S, D, generator=g, dtype=torch.float64),
        torch.randn(kv_batch, G, S, dv, generator=g, dtype=torch.float64),
        torch.randn(B, H, T, dv, generator=g, dtype=torch.float64),  # the output's gradient
    )


def reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, mask, q_offset: int):
    """(out, lse, (dq, dk, dv)) of the reference on all the keys."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, (_, lse) = dikkat.attention(*leaves, mask, q_offset=q_offset, backend="reference",
                                     return_lse=True)  # fmt: skip
    return out.detach(), lse, torch.autograd.grad(out, leaves, dout)


def block_mask(mask, lo: int, hi: int):
    """The mask on keys lo:hi, as the call on those keys sees it (queries placed by q_offset)."""
    return mask[..., lo:hi] if isinstance(mask, Tensor) else mask


def blockwise(q, k, v, out, lse, dout, mask, q_offset: int, **tiling) -> tuple[Tensor, ...]:
    """Each block's gradients from the final out and lse; dq summed, dk and dv put side by side."""
    parts = []
    for lo, hi in ((0, SPLIT), (SPLIT, S)):
        kb, vb, mb = k[:, :, lo:hi], v[:, :, lo:hi], block_mask(mask, lo, hi)
        parts.append(tiled_backward(q, kb, vb, out, lse, dout, mb, scale=SCALE,
                                    q_offset=q_offset - lo, **tiling))  # fmt: skip
    assert all(p[0].abs().max() > 0 for p in parts), "a block contributes nothing to dq"
    (dq1, dk1, dv1), (dq2, dk2, dv2) = parts
    return dq1 + dq2, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2)


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("dv", [D, 6])  # Dv = D: the fused CPU kernel; Dv ≠ D: plain ops
@pytest.mark.parametrize("name", MASKS)
def test_blocks_add_up_to_the_whole_gradient(name, dv, tiling):
    mask, q_offset = MASKS[name]
    q, k, v, dout = tensors(dv)
    out, lse, want = reference(q, k, v, dout, mask, q_offset)
    assert min(w.abs().max() for w in want) > 0.1  # the comparison is not trivially true
    if name == "dense":
        assert torch.isneginf(lse[0, :, 3]).all()
    got = blockwise(q, k, v, out, lse, dout, mask, q_offset, **TILINGS[tiling])
    for label, g, w in zip("qkv", got, want, strict=True):
        assert g.shape == w.shape and g.dtype == torch.float64, label
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"d{label}, {name}")


def test_keys_shared_by_the_batch_get_the_batch_sum():
    q, k, v, dout = tensors(D, kv_batch=1)
    mask, q_offset = MASKS["causal"]
    out, lse, want = reference(q, k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1), dout, mask,
                               q_offset)  # fmt: skip
    dq, dk, dv = blockwise(q, k, v, out, lse, dout, mask, q_offset)
    assert dk.shape == k.shape and dv.shape == v.shape
    torch.testing.assert_close(dq, want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dk, want[1].sum(0, keepdim=True), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv, want[2].sum(0, keepdim=True), rtol=1e-10, atol=1e-10)


def test_a_single_block_in_fp32_is_the_tiled_backends_gradient():
    q, k, v, dout = (t.float() for t in tensors(D))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, (_, lse) = dikkat.attention(*leaves, masks.causal(), q_offset=OFFSET, backend="tiled",
                                     return_lse=True)  # fmt: skip
    want = torch.autograd.grad(out, leaves, dout)
    got = tiled_backward(q, k, v, out.detach(), lse, dout, masks.causal(), scale=SCALE,
                         q_offset=OFFSET)  # fmt: skip
    for label, g, w in zip("qkv", got, want, strict=True):
        assert g.dtype == torch.float32, label
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"d{label}")


def test_bad_results_are_named():
    q, k, v, dout = tensors(D)
    out, lse = torch.zeros_like(dout), torch.zeros(B, H, T, dtype=torch.float64)

    def call(**changed: Tensor) -> None:
        args = {"out": out, "lse": lse, "dout": dout} | changed
        tiled_backward(q, k, v, args["out"], args["lse"], args["dout"], scale=SCALE)

    with pytest.raises(ValueError, match=r"out must have shape \(2, 4, 12, 8\).*\(2, 4, 12, 6\)"):
        call(out=out[..., :6])
    with pytest.raises(ValueError, match="lse must have shape"):
        call(lse=lse[:, :, :5])
    with pytest.raises(TypeError, match=r"dout must have q's dtype torch\.float64, got torch\.fl"):
        call(dout=dout.float())
    with pytest.raises(ValueError, match="scale must be finite"):
        tiled_backward(q, k, v, out, lse, dout, scale=float("nan"))
