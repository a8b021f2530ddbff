"""One tile: softmax(cap(q kᵀ·scale) + additive) v with its log-sum-exp, and its gradients.

Notation: ``B`` batch, ``X`` heads (or query blocks) of the call, ``R`` query rows and ``K`` keys
of a tile, ``D``/``Dv`` head dims; ``G`` key/value heads and ``g`` query heads per key/value head
(``H = G·g``) where a tile's rows stack the query heads of a key/value head.

A tile is q (B, X, R, D), k (B, X, K, D), v (B, X, K, Dv) and an additive mask (B|1, X|1, R, K)
or None. When the call allows it (``fused``) the tile runs in PyTorch's fused CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which takes an additive mask and returns the
log-sum-exp) and its backward; otherwise in plain tensor ops, written out here. That kernel reads
the last dim of q, k, v and the output as laid out with stride 1 whatever their strides say
(seen with torch 2.13; https://github.com/pytorch/pytorch/pull/187506 makes the kernel copy such
inputs itself): a tile of a transposed or sliced view goes to it as a contiguous copy
(:func:`unit_last_stride`). ``cap`` is the identity, or with ``softcap`` c the soft-cap
s ↦ c · tanh(s / c) of Gemma 2 (docs/attention.md, "Soft-capping"), which the fused kernel cannot
apply: a soft-capped call runs plain ops.

The plain backward recomputes the tile's weights from the whole attention's log-sum-exp,
P = exp(s − lse), and with dP = dO Vᵀ the gradient of the scores is dS = P ∘ (dP − rowsum(dO ∘ O))
(FlashAttention-2, Dao 2023, arXiv:2307.08691, Algorithm 2). The bias enters the scores
additively, after the cap, so dS is its gradient too, summed over the dimensions the bias
broadcasts along (:func:`add_bias_grad`). The fused backward returns dq, dk and dv but not dS: a
tile whose bias needs a gradient runs the plain backward. With the cap, the gradient of the
scaled scores s = q kᵀ·scale is dS ∘ (1 − tanh²(s / c)), since d/ds c · tanh(s / c) =
1 − tanh²(s / c).
"""

from __future__ import annotations

import torch
from torch import Tensor

# PyTorch's fused CPU flash kernel (absent from some builds: then every tile runs plain ops)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fused_unavailable(q: Tensor, v: Tensor, softcap: float | None = None) -> str | None:
    """None when the fused CPU kernel can run this call's tiles, else the reason it cannot."""
    if softcap is not None:
        return (
            "softcap is set, and the fused kernel computes softmax(q kᵀ·scale + mask) with no "
            "score modifier"
        )
    if q.device.type != "cpu":
        return f"q is on {q.device.type}, and the fused kernel is PyTorch's CPU one"
    if v.shape[-1] != q.shape[-1]:
        return (
            f"v has head dim Dv = {v.shape[-1]} and q D = {q.shape[-1]}: the fused kernel "
            "takes one head dim for queries, keys and values"
        )
    if _FLASH_CPU is None:
        return f"torch {torch.__version__} has no _scaled_dot_product_flash_attention_for_cpu"
    return None


def unit_last_stride(x: Tensor) -> Tensor:
    """x, or a contiguous copy of it when its last dim is not laid out with stride 1 (a
    transposed or sliced view, an expanded one): what the fused CPU kernel reads correctly."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def capped_scores(
    q: Tensor, k: Tensor, scale: float, softcap: float | None
) -> tuple[Tensor, Tensor | None]:
    """(cap(q kᵀ·scale) (B, X, R, K) in the accumulator dtype, tanh(s / c) or None without a
    cap): the tanh is what the backward's 1 − tanh² needs."""
    s = (q @ k.transpose(-2, -1)).to(acc_dtype(q.dtype)).mul_(scale)
    if softcap is None:
        return s, None
    t = s.div_(softcap).tanh_()
    return t * softcap, t


def tile_forward(
    q: Tensor, k: Tensor, v: Tensor, additive: Tensor | None, scale: float, fused: bool,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out (B, X, R, Dv) in the accumulator dtype, lse (B, X, R)); rows whose every key is
    masked get out 0 and an arbitrary lse (the caller sets −inf there). ``fused`` needs
    ``softcap`` None (:func:`fused_unavailable`)."""
    acc = acc_dtype(q.dtype)
    if fused:
        q, k, v = (unit_last_stride(t) for t in (q, k, v))
        out, lse = _FLASH_CPU(q, k, v, attn_mask=additive, scale=scale)
        return out.to(acc), lse.to(acc)
    s, _ = capped_scores(q, k, scale, softcap)
    if additive is not None:
        s = s.add_(additive.to(acc))
    m = s.amax(-1)
    m = m.masked_fill(torch.isneginf(m), 0.0)
    p = s.sub_(m.unsqueeze(-1)).exp_()
    l = p.sum(-1)  # noqa: E741 — the softmax denominator, as in the papers
    out = (p.to(v.dtype) @ v).to(acc) / l.clamp(min=torch.finfo(acc).tiny).unsqueeze(-1)
    return out, m + torch.log(l)


def tile_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    additive: Tensor | None,
    scale: float,
    fused: bool,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The tile's share of (dq, dk, dv) given the *whole* attention's out and lse (rows with no
    visible key must carry a finite lse; their weights are 0 through the mask). ``fused``
    needs ``softcap`` None."""
    if fused:
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dout, q, k, v, out = (unit_last_stride(t) for t in (dout, q, k, v, out))
        return backward(
            dout,
            q,
            k,
            v,
            out,
            lse.to(acc_dtype(q.dtype)),
            0.0,
            False,
            attn_mask=additive,
            scale=scale,
        )
    return plain_tile_backward(dout, q, k, v, out, lse, additive, scale, softcap)[:3]


def plain_tile_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    additive: Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dS) of one tile: q (B, X, R, D), k (B, X, K, D), v (B, X, K, Dv), additive
    (B|1, X|1, R, K) or None; dS (B, X, R, K), the gradient of the scores after the cap (that of
    the bias), in the accumulator dtype. ``out`` and ``lse`` are the whole attention's (a row
    with no visible key must carry a finite lse: its weights are 0 through the mask)."""
    acc = acc_dtype(q.dtype)
    s, t = capped_scores(q, k, scale, softcap)
    if additive is not None:
        s = s.add_(additive.to(acc))
    p = s.sub_(lse.to(acc).unsqueeze(-1)).exp_()  # the weights, recomputed from the lse
    delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
    dv = p.to(dout.dtype).transpose(-2, -1) @ dout
    ds = p.mul_((dout @ v.transpose(-2, -1)).to(acc).sub_(delta))  # dS = P ∘ (dP − delta)
    # the scores are cap(q kᵀ · scale): through the cap, d/ds c · tanh(s / c) = 1 − tanh²(s / c)
    dsq = ds * scale if t is None else ds * t.square_().neg_().add_(1.0).mul_(scale)
    dsq = dsq.to(q.dtype)
    return dsq @ k, dsq.transpose(-2, -1) @ q, dv, ds


def add_bias_grad(dbias: Tensor, ds: Tensor, g: int, r0: int, r1: int, k0: int, k1: int) -> None:
    """Add the dS (B, G, g·R, K) of query rows r0:r1 against keys k0:k1 into ``dbias`` (B|1, H|1,
    T|1, S|1), summed over the dimensions where the bias has size 1."""
    B, G = ds.shape[:2]
    R, K = r1 - r0, k1 - k0
    ds = ds.reshape(B, G * g, R, K)  # (B, G, g·R, K) → (B, H, R, K): head h = G-group · g + i
    Bb, Hb, Tb, Sb = dbias.shape
    rows = slice(r0, r1) if Tb > 1 else slice(None)
    cols = slice(k0, k1) if Sb > 1 else slice(None)
    dbias[:, :, rows, cols] += ds.sum_to_size(Bb, Hb, R if Tb > 1 else 1, K if Sb > 1 else 1)
