"""The forward kernel: FlashAttention-2's online softmax over the key blocks a query block visits.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``g = H / G``, ``T``/``S``
query/key length, ``D``/``Dv`` head dims, ``BM``/``BN`` query/key rows per block, ``BD``/``BDV``
the head dims rounded up to a power of two (the padding is loaded as 0).

One program per (query block, batch · head). It walks the key blocks of its row of the block
plan (:mod:`dikkat.core.triton.blocks`), keeping each row's running maximum ``m``, sum ``l`` and
unnormalised output (Dao 2023, arXiv:2307.08691, Algorithm 1), and writes ``out = acc / l`` and
``lse = m + log l`` in fp32 (−inf, and output 0, for a row that sees no key). A partial block's
mask is its tile, or for a band ``lo ≤ q − k < hi`` computed here. Keys and values are read from
the group's one k/v head: GQA without repeating them.

This module imports triton at the top: it is itself imported only when a kernel runs
(:mod:`dikkat.core.triton.autograd`), since triton is an optional dependency.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dikkat.core.triton.blocks import BlockPlan
from dikkat.core.triton.launch import Launch

__all__ = ["allowed_pairs", "forward"]


@triton.jit
def allowed_pairs(
    Tiles, tile, b, h, stp, stb, sth, offs_m, offs_n, q_offset, S, band_lo, band_hi,
    BAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(BM, BN) bool: the pairs of this block that may attend (keys past S never)."""
    ok = offs_n[None, :] < S
    # a full block (tile −1) reads nothing: its load is masked off, every pair allowed
    limit = tl.where(tile >= 0, BLOCK_N, 0)
    cols = tl.arange(0, BLOCK_N)
    base = Tiles + tl.maximum(tile, 0).to(tl.int64) * stp + b * stb + h * sth
    cells = base + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + cols[None, :]
    ok = ok & (tl.load(cells, mask=cols[None, :] < limit, other=1) != 0)
    if BAND:
        distance = (q_offset + offs_m)[:, None] - offs_n[None, :]
        ok = ok & (distance >= band_lo) & (distance < band_hi)
    return ok


@triton.jit
def _forward_kernel(
    Q, K, V, Out, Lse, Bias, Tiles, row_ptr, row_inner, row_tile,
    sqb, sqh, sqt, sqd, skb, skg, sks, skd, svb, svg, svs, svd, sob, soh, sot, sod,
    sbb, sbh, sbt, sbs, stp, stb, sth,
    H, g, T, S, D, DV, q_offset, scale, band_lo, band_hi,
    HAS_BIAS: tl.constexpr, BAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // g  # the key/value head of this query head's group
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m[:, None] < T
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=rows & (offs_d[None, :] < D),
        other=0.0,
    )  # (BM, BD)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for i in range(tl.load(row_ptr + m), tl.load(row_ptr + m + 1)):
        n = tl.load(row_inner + i)
        offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
        keys = offs_n[None, :] < S
        kt = tl.load(
            K + b * skb + hk * skg + offs_n[None, :] * sks + offs_d[:, None] * skd,
            mask=keys & (offs_d[:, None] < D),
            other=0.0,
        )  # (BD, BN): the keys, transposed
        s = tl.dot(q, kt, input_precision=PRECISION) * scale  # (BM, BN)
        if HAS_BIAS:
            s += tl.load(
                Bias + b * sbb + h * sbh + offs_m[:, None] * sbt + offs_n[None, :] * sbs,
                mask=rows & keys,
                other=0.0,
            ).to(tl.float32)
        ok = allowed_pairs(
            Tiles, tl.load(row_tile + i), b, h, stp, stb, sth, offs_m, offs_n, q_offset, S,
            band_lo, band_hi, BAND, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + b * svb + hk * svg + offs_n[:, None] * svs + offs_dv[None, :] * svd,
            mask=(offs_n[:, None] < S) & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (BN, BDV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(
        Out + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :] * sod,
        out.to(Out.dtype.element_ty),
        mask=rows & (offs_dv[None, :] < DV),
    )
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(Lse + bh.to(tl.int64) * T + offs_m, lse, mask=offs_m < T)


def forward(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, plan: BlockPlan, launch: Launch
) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv) in q's dtype, lse (B, H, T) fp32)``; k, v (B, G, S, ·) (any strides,
    stride 0 for a shared batch), bias (B|1, H|1, T|1, S|1) or None."""
    B, H, T, D = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty(B, H, T, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, plan.block_m), B * H)
    if 0 in grid:  # no query rows: nothing to write
        return out, lse
    _forward_kernel[grid](
        q, k, v, out, lse, q if bias is None else bias, plan.tiles,
        plan.rows.ptr, plan.rows.inner, plan.rows.tile,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *launch.bias_strides(bias), *plan.tile_strides(),
        H, H // G, T, S, D, Dv, launch.q_offset, launch.scale, *launch.band(plan),
        HAS_BIAS=bias is not None, BAND=plan.band is not None, PRECISION=launch.precision,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=launch.block_d,
        BLOCK_DV=launch.block_dv, num_warps=launch.num_warps,
    )  # fmt: skip
    return out, lse
