"""The two Triton kernels of :func:`dikkat.core.triton.decode.triton_decode` (flash-decoding).

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` query length, ``S`` key
length, ``D`` query/key head dim, ``Dv`` value head dim; ``n_split`` chunks of keys.

This module imports triton at its top: only ``decode.py`` imports it, inside the function that
launches the kernels, so ``import dikkat`` never needs triton. Whether the kernels run under
Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1``) is fixed when this module is first
imported, as ``triton.jit`` reads the setting when it wraps a function.

:func:`split_kernel` is one program per (batch row · key/value head, split, block of query rows):
the ``T · H/G`` queries of a key/value head's group share every key and value block it loads
(rows are ordered head-major: row r is head ``g · H/G + r // T``, query ``r % T``; a group of
more rows than one block holds is cut into row blocks, each loading the keys again). It runs the
online softmax of FlashAttention (Dao et al. 2022, arXiv:2205.14135, Algorithm 1) over its chunk of
keys in base 2 and writes the chunk's normalised output and log-sum-exp. :func:`merge_kernel`
combines the chunks of one row by their log-sum-exps, as flash-decoding does (Dao et al. 2023,
"Flash-Decoding for long-context inference", crfm.stanford.edu/2023/10/12/flashdecoding.html).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def split_kernel(
    Q,
    K,
    V,
    Allowed,
    OutPart,
    LsePart,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kg,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vg,
    stride_vs,
    stride_vd,
    stride_ab,
    stride_ah,
    stride_at,
    stride_as,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_os,
    stride_lb,
    stride_lh,
    stride_lt,
    stride_ls,
    qk_scale,  # scale · log2(e): the scores in base 2
    G,
    T,
    group,  # H // G
    D,
    Dv,
    kv_lo,  # keys kv_lo … kv_hi − 1 hold every key a query may see
    kv_hi,
    chunk,  # keys per split
    HAS_MASK: tl.constexpr,  # Allowed holds the mask over kv_lo … kv_hi − 1
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = (tl.program_id(0) // G).to(tl.int64)  # int64: a long cache's batch stride is large
    g = (tl.program_id(0) % G).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * T
    h = g * group + rows // T  # (BLOCK_M,)
    t = rows % T
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)

    q_ptrs = Q + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt
    q = tl.load(q_ptrs + d[None, :] * stride_qd, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of 2^(score − m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    start = kv_lo + split * chunk
    end = tl.minimum(start + chunk, kv_hi)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        k_ptrs = K + b * stride_kb + g * stride_kg + n[:, None] * stride_ks + d[None, :] * stride_kd
        k = tl.load(k_ptrs, mask=n_ok[:, None] & (d[None, :] < D), other=0.0)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        ok = row_ok[:, None] & n_ok[None, :]
        if HAS_MASK:
            a_ptrs = Allowed + b * stride_ab + h[:, None] * stride_ah + t[:, None] * stride_at
            allowed = tl.load(a_ptrs + (n - kv_lo)[None, :] * stride_as, mask=ok, other=0)
            ok = ok & (allowed != 0)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no visible key so far keeps m = −inf: subtract 0 instead, so every p is 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = (
            V + b * stride_vb + g * stride_vg + n[:, None] * stride_vs + dv[None, :] * stride_vd
        )
        v = tl.load(v_ptrs, mask=n_ok[:, None] & (dv[None, :] < Dv), other=0.0)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    empty = l_i == 0.0  # no visible key in this chunk: output 0, log-sum-exp −inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)  # × ln 2
    o_ptrs = OutPart + b * stride_ob + h[:, None] * stride_oh + t[:, None] * stride_ot
    o_ptrs += split * stride_os + dv[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & (dv[None, :] < Dv))
    l_ptrs = LsePart + b * stride_lb + h * stride_lh + t * stride_lt + split * stride_ls
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def merge_kernel(
    OutPart,  # (R, n_split, Dv) fp32, R = B · H · T rows, contiguous
    LsePart,  # (R, n_split) fp32
    Out,  # (R, Dv) in q's dtype
    Lse,  # (R,) fp32
    n_split,
    Dv,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    lse_s = tl.load(LsePart + r * n_split + sp, mask=sp < n_split, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # (BLOCK_S,): 0 for a chunk that saw no key
    total = tl.sum(w, 0)
    o_ptrs = OutPart + (r * n_split + sp[:, None]) * Dv + dv[None, :]
    o = tl.load(o_ptrs, mask=(sp[:, None] < n_split) & (dv[None, :] < Dv), other=0.0)
    empty = total == 0.0
    out = tl.sum(w[:, None] * o, 0) / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    tl.store(Out + r * Dv + dv, out.to(Out.dtype.element_ty), mask=dv < Dv)
    tl.store(Lse + r, lse)


# True when the kernels above run under Triton's interpreter (on CPU tensors)
INTERPRETED: bool = isinstance(split_kernel, InterpretedFunction)
