"""Exact attention over tiles with the online softmax: the T×S score matrix never exists (S16).

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (``g = H / G`` query heads per
key/value head), ``T``/``S`` query/key length, ``D``/``Dv`` head dims, ``bq``/``bk`` tile sizes.

For each block of queries the keys are visited a block at a time, keeping per row the running
maximum ``m``, the running sum ``l`` of exp(score − m) and the running weighted sum of values;
when a larger maximum appears the old sums are rescaled by exp(m_old − m_new). At the end
``out = acc / l`` and the log-sum-exp ``lse = m + log l`` is kept per row. Extra memory is
O((T + S)·D + bq·bk) instead of O(T·S).

The mask is evaluated tile by tile from its predicate: a tile with no allowed pair is skipped,
not computed (a causal mask does about half the work); a tile with every pair allowed needs no
masking. The backward pass is a custom autograd function that recomputes each tile's weights
from the saved log-sum-exp, so training memory is O(n) too.

What differs from the reference: the sum runs in a different order (so results differ by
rounding), matmuls run in the input dtype but the softmax statistics and accumulators in fp32,
and there is no dropout. Rows with every key masked give output 0 and ``lse = −inf``.
Python loops over the tiles: correct and O(n) in memory, not yet as fast as SDPA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dikkat.core.masks import Mask

BLOCK = 128  # tile edge: 128 × 128 fp32 scores = 64 KiB, comfortably inside L2


def _tile_mask(
    mask: Mask | None, B: int, H: int, G: int, q0: int, q1: int, k0: int, k1: int, device
) -> Tensor | bool | None:
    """The tile's allowed pairs as a bool tensor viewable as (B|1, G|1, g|1, bq, bk); ``True``
    when every pair is allowed, ``False`` when none is (skip the tile), None without a mask."""
    if mask is None:
        return None
    allowed = mask.evaluate(
        torch.arange(B, device=device),
        torch.arange(H, device=device),
        torch.arange(q0, q1, device=device),
        torch.arange(k0, k1, device=device),
    )
    if not bool(allowed.any()):
        return False
    if bool(allowed.all()):
        return True
    Bm, Hm = allowed.shape[0], allowed.shape[1]
    if Hm == 1:
        return allowed.view(Bm, 1, 1, *allowed.shape[2:])
    return allowed.view(Bm, G, H // G, *allowed.shape[2:])  # head h = g·group + i


def _key_blocks(mask: Mask | None, q0: int, q1: int, S: int, block: int) -> range:
    """Starts of the key blocks that may hold visible keys for queries q0 … q1 − 1: the mask's
    ``kv_range`` bounds them, so a sliding window or causal mask never visits the rest."""
    lo, hi = (0, S) if mask is None else mask.kv_range(q0, q1, S)
    return range((lo // block) * block, hi, block)


def _bias_tile(bias: Tensor | None, G: int, q0: int, q1: int, k0: int, k1: int) -> Tensor | None:
    """The bias entries of one tile, viewable against (B, G, g, bq, bk)."""
    if bias is None:
        return None
    rows = slice(q0, q1) if bias.shape[2] > 1 else slice(None)
    cols = slice(k0, k1) if bias.shape[3] > 1 else slice(None)
    t = bias[:, :, rows, cols]
    Bb, Hb = t.shape[0], t.shape[1]
    return t.view(Bb, 1, 1, *t.shape[2:]) if Hb == 1 else t.reshape(Bb, G, Hb // G, *t.shape[2:])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(
    qb: Tensor, kb: Tensor, scale: float, bias: Tensor | None, allowed: Tensor | bool | None
) -> Tensor:
    """Scores of one tile in the accumulator dtype, (B, G, g, bq, bk), masked entries −inf."""
    acc = _acc_dtype(qb.dtype)
    s = (qb @ kb.transpose(-2, -1)).to(acc) * scale
    if bias is not None:
        s = s + bias.to(acc)
    if isinstance(allowed, Tensor):
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    scale: float,
    bias: Tensor | None,
    q_offset: int,
    block: int,
) -> tuple[Tensor, Tensor]:
    B, H, T, _ = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    qg = q.reshape(B, G, H // G, T, -1)  # (B, G, g, T, D): query heads grouped by kv head
    kg, vg = k.unsqueeze(2), v.unsqueeze(2)  # (B, G, 1, S, D)
    out = q.new_empty(B, G, H // G, T, Dv)
    acc_dtype = _acc_dtype(q.dtype)
    lse = torch.empty(B, G, H // G, T, dtype=acc_dtype, device=q.device)
    for q0 in range(0, T, block):
        q1 = min(q0 + block, T)
        qb = qg[:, :, :, q0:q1]
        m = torch.full((B, G, H // G, q1 - q0), float("-inf"), dtype=acc_dtype, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741 — the running sum, as in the papers
        acc = torch.zeros(B, G, H // G, q1 - q0, Dv, dtype=acc_dtype, device=q.device)
        for k0 in _key_blocks(mask, q0 + q_offset, q1 + q_offset, S, block):
            k1 = min(k0 + block, S)
            allowed = _tile_mask(mask, B, H, G, q0 + q_offset, q1 + q_offset, k0, k1, q.device)
            if allowed is False:
                continue  # nothing visible here: skip the tile entirely
            s = _scores(qb, kg[:, :, :, k0:k1], scale, _bias_tile(bias, G, q0, q1, k0, k1), allowed)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # rows with nothing seen yet
            p = torch.exp(s - m_safe.unsqueeze(-1))
            correction = torch.exp(m - m_safe)
            l = l * correction + p.sum(-1)  # noqa: E741
            acc = acc * correction.unsqueeze(-1) + (p.to(v.dtype) @ vg[:, :, :, k0:k1]).to(
                acc_dtype
            )
            m = m_new
        empty = l == 0
        out[:, :, :, q0:q1] = (acc / l.masked_fill(empty, 1.0).unsqueeze(-1)).to(out.dtype)
        lse[:, :, :, q0:q1] = torch.where(
            empty, float("-inf"), m + torch.log(l.masked_fill(empty, 1.0))
        )
    return out.view(B, H, T, Dv), lse.view(B, H, T)


def _backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    mask: Mask | None,
    scale: float,
    bias: Tensor | None,
    q_offset: int,
    block: int,
) -> tuple[Tensor, Tensor, Tensor]:
    B, H, T, D = q.shape
    G, S = k.shape[1], k.shape[2]
    g = H // G
    qg = q.reshape(B, G, g, T, D)
    kg, vg = k.unsqueeze(2), v.unsqueeze(2)
    dog = dout.reshape(B, G, g, T, -1)
    # rows with no visible key: lse = −inf; make their recomputed weights exactly 0
    lse_g = lse.view(B, G, g, T)
    lse_g = lse_g.masked_fill(torch.isneginf(lse_g), float("inf"))
    acc = _acc_dtype(q.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).reshape(B, G, g, T)  # rowsum(dO ∘ O)
    dq = torch.zeros(B, G, g, T, D, dtype=acc, device=q.device)
    dk = torch.zeros(B, G, g, S, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, G, g, S, v.shape[3], dtype=acc, device=q.device)
    for q0 in range(0, T, block):
        q1 = min(q0 + block, T)
        qb, dob = qg[:, :, :, q0:q1], dog[:, :, :, q0:q1]
        for k0 in _key_blocks(mask, q0 + q_offset, q1 + q_offset, S, block):
            k1 = min(k0 + block, S)
            allowed = _tile_mask(mask, B, H, G, q0 + q_offset, q1 + q_offset, k0, k1, q.device)
            if allowed is False:
                continue
            kb, vb = kg[:, :, :, k0:k1], vg[:, :, :, k0:k1]
            s = _scores(qb, kb, scale, _bias_tile(bias, G, q0, q1, k0, k1), allowed)
            p = torch.exp(s - lse_g[:, :, :, q0:q1].unsqueeze(-1))  # the weights, recomputed
            dv[:, :, :, k0:k1] += (p.to(dout.dtype).transpose(-2, -1) @ dob).to(acc)
            dp = (dob @ vb.transpose(-2, -1)).to(acc)
            ds = p * (dp - delta[:, :, :, q0:q1].unsqueeze(-1)) * scale
            dq[:, :, :, q0:q1] += (ds.to(q.dtype) @ kb).to(acc)
            dk[:, :, :, k0:k1] += (ds.to(q.dtype).transpose(-2, -1) @ qb).to(acc)
    # each key/value head served g query heads: their gradients add up
    return (
        dq.view(B, H, T, D).to(q.dtype),
        dk.sum(2).to(k.dtype),
        dv.sum(2).to(v.dtype),
    )


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, bias, q_offset, block):
        out, lse = _forward(q, k, v, mask, scale, bias, q_offset, block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (mask, scale, bias, q_offset, block)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale, bias, q_offset, block = ctx.args
        dq, dk, dv = _backward(q, k, v, out, lse, dout, mask, scale, bias, q_offset, block)
        return dq, dk, dv, None, None, None, None, None


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None = None,
    *,
    scale: float,
    bias: Tensor | None = None,
    q_offset: int = 0,
    block: int = BLOCK,
) -> tuple[Tensor, Tensor]:
    """Exact attention in tiles: ``(out (B, H, T, Dv), lse (B, H, T))``, lse in fp32 (fp64 for
    fp64 inputs).

    Differentiable in q, k and v (the bias is treated as a constant).
    """
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if bias is not None:  # a constant, viewed as (B|1, H|1, T|1, S|1)
        bias = bias.detach()
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    return _TiledAttention.apply(q, k, v, mask, scale, bias, q_offset, block)
