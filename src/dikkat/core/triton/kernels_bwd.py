"""The backward kernels: FlashAttention-2's, recomputing the weights from the saved lse.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``g = H / G``, ``T``/``S``
query/key length, ``D``/``Dv`` head dims, ``BM``/``BN`` query/key rows per block.

With P = exp(s − lse) recomputed block by block and delta = rowsum(dO ⊙ O) (Dao 2023,
arXiv:2307.08691, Algorithm 2): dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ − delta), dK = scale · dSᵀ Q,
dQ = scale · dS K. Two kernels, so that nothing is accumulated by atomics (deterministic):

- dK/dV: one program per (key block, batch · key/value head); it walks the query blocks of its
  column of the block plan for each of the group's g query heads, so GQA's sum over a group
  happens here, with no repeated k/v and no second reduction;
- dQ: one program per (query block, batch · query head), over its row of the plan.

delta is one fp32 reduction over (B, H, T, Dv) done by PyTorch before the kernels (FA2's
"preprocess" step). Imported only when a kernel runs: triton is an optional dependency.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dikkat.core.triton.blocks import BlockPlan
from dikkat.core.triton.kernels_fwd import allowed_pairs
from dikkat.core.triton.launch import Launch

__all__ = ["backward"]


@triton.jit
def _weights(
    q, kt, lse, Bias, Tiles, tile, b, h, offs_m, offs_n, rows, sbb, sbh, sbt, sbs,
    stp, stb, sth, S, q_offset, scale, band_lo, band_hi,
    HAS_BIAS: tl.constexpr, BAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(BM, BN) fp32: P = exp(s − lse), 0 where the pair is masked or the row sees no key."""
    s = tl.dot(q, kt, input_precision=PRECISION) * scale
    if HAS_BIAS:
        s += tl.load(
            Bias + b * sbb + h * sbh + offs_m[:, None] * sbt + offs_n[None, :] * sbs,
            mask=rows[:, None] & (offs_n[None, :] < S),
            other=0.0,
        ).to(tl.float32)
    ok = allowed_pairs(
        Tiles, tile, b, h, stp, stb, sth, offs_m, offs_n, q_offset, S, band_lo, band_hi,
        BAND, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    safe = tl.where(lse == float("-inf"), float("inf"), lse)  # no key seen: every weight 0
    return tl.where(ok, tl.exp(s - safe[:, None]), 0.0)


@triton.jit
def _dkdv_kernel(
    Q, K, V, dO, Lse, Delta, dK, dV, Bias, Tiles, col_ptr, col_inner, col_tile,
    sqb, sqh, sqt, sqd, skb, skg, sks, skd, svb, svg, svs, svd, sob, soh, sot, sod,
    sbb, sbh, sbt, sbs, stp, stb, sth,
    H, G, g, T, S, D, DV, q_offset, scale, band_lo, band_hi,
    HAS_BIAS: tl.constexpr, BAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    hk = (bg % G).to(tl.int64)
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    keys = offs_n[:, None] < S
    k = tl.load(
        K + b * skb + hk * skg + offs_n[:, None] * sks + offs_d[None, :] * skd,
        mask=keys & (offs_d[None, :] < D),
        other=0.0,
    )  # (BN, BD)
    v = tl.load(
        V + b * svb + hk * svg + offs_n[:, None] * svs + offs_dv[None, :] * svd,
        mask=keys & (offs_dv[None, :] < DV),
        other=0.0,
    )  # (BN, BDV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    start = tl.load(col_ptr + n)
    end = tl.load(col_ptr + n + 1)
    for j in range(0, g):
        h = hk * g + j
        row0 = (b * H + h) * T  # this head's rows of lse and delta
        for i in range(start, end):
            m = tl.load(col_inner + i)
            offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
            rows = offs_m < T
            q = tl.load(
                Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=rows[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )
            do = tl.load(
                dO + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :] * sod,
                mask=rows[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )
            lse = tl.load(Lse + row0 + offs_m, mask=rows, other=float("-inf"))
            delta = tl.load(Delta + row0 + offs_m, mask=rows, other=0.0)
            p = _weights(
                q,
                tl.trans(k),
                lse,
                Bias,
                Tiles,
                tl.load(col_tile + i),
                b,
                h,
                offs_m,
                offs_n,
                rows,
                sbb,
                sbh,
                sbt,
                sbs,
                stp,
                stb,
                sth,
                S,
                q_offset,
                scale,
                band_lo,
                band_hi,
                HAS_BIAS,
                BAND,
                PRECISION,
                BLOCK_M,
                BLOCK_N,
            )  # fmt: skip  (BM, BN)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    # dK and dV have k's and v's (B, G, S, ·) layout, contiguous
    tl.store(
        dK + ((b * G + hk) * S + offs_n[:, None]) * D + offs_d[None, :],
        (dk * scale).to(dK.dtype.element_ty),
        mask=keys & (offs_d[None, :] < D),
    )
    tl.store(
        dV + ((b * G + hk) * S + offs_n[:, None]) * DV + offs_dv[None, :],
        dv.to(dV.dtype.element_ty),
        mask=keys & (offs_dv[None, :] < DV),
    )


@triton.jit
def _dq_kernel(
    Q, K, V, dO, Lse, Delta, dQ, Bias, Tiles, row_ptr, row_inner, row_tile,
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
    hk = h // g
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m < T
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=rows[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    do = tl.load(
        dO + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :] * sod,
        mask=rows[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    lse = tl.load(Lse + bh.to(tl.int64) * T + offs_m, mask=rows, other=float("-inf"))
    delta = tl.load(Delta + bh.to(tl.int64) * T + offs_m, mask=rows, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(tl.load(row_ptr + m), tl.load(row_ptr + m + 1)):
        n = tl.load(row_inner + i)
        offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
        keys = offs_n[:, None] < S
        k = tl.load(
            K + b * skb + hk * skg + offs_n[:, None] * sks + offs_d[None, :] * skd,
            mask=keys & (offs_d[None, :] < D),
            other=0.0,
        )  # (BN, BD)
        v = tl.load(
            V + b * svb + hk * svg + offs_n[:, None] * svs + offs_dv[None, :] * svd,
            mask=keys & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (BN, BDV)
        p = _weights(
            q, tl.trans(k), lse, Bias, Tiles, tl.load(row_tile + i), b, h, offs_m, offs_n,
            rows, sbb, sbh, sbt, sbs, stp, stb, sth, S, q_offset, scale, band_lo, band_hi,
            HAS_BIAS, BAND, PRECISION, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(
        dQ + (bh.to(tl.int64) * T + offs_m[:, None]) * D + offs_d[None, :],
        (dq * scale).to(dQ.dtype.element_ty),
        mask=rows[:, None] & (offs_d[None, :] < D),
    )


def backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    bias: Tensor | None, plan: BlockPlan, launch: Launch,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` of q's, k's and v's shapes (dk, dv per batch entry, also for k, v
    shared by the batch: autograd sums them over the broadcast)."""
    B, H, T, D = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, H, T)
    dq = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, G, S, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, G, S, Dv, dtype=v.dtype, device=q.device)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    shared = (*launch.bias_strides(bias), *plan.tile_strides())
    flags = dict(
        HAS_BIAS=bias is not None, BAND=plan.band is not None, PRECISION=launch.precision,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=launch.block_d,
        BLOCK_DV=launch.block_dv, num_warps=launch.num_warps,
    )  # fmt: skip
    bias_arg = q if bias is None else bias  # any pointer: HAS_BIAS=False never reads it
    band = launch.band(plan)
    if B * H * T == 0:  # no query rows: no gradient flows to any key
        return dq, dk.zero_(), dv.zero_()
    if S > 0:  # (with no keys, dq below is 0)
        _dkdv_kernel[(triton.cdiv(S, plan.block_n), B * G)](
            q, k, v, dout, lse, delta, dk, dv, bias_arg, plan.tiles,
            plan.cols.ptr, plan.cols.inner, plan.cols.tile, *strides, *shared,
            H, G, H // G, T, S, D, Dv, launch.q_offset, launch.scale, *band, **flags,
        )  # fmt: skip
    _dq_kernel[(triton.cdiv(T, plan.block_m), B * H)](
        q, k, v, dout, lse, delta, dq, bias_arg, plan.tiles,
        plan.rows.ptr, plan.rows.inner, plan.rows.tile, *strides, *shared,
        H, H // G, T, S, D, Dv, launch.q_offset, launch.scale, *band, **flags,
    )  # fmt: skip
    return dq, dk, dv
