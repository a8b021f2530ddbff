"""The plain-ops backward of one tile of the tiled backend, and the gradient of a learnable bias.

Notation: ``B`` batch, ``G`` key/value heads, ``g`` query heads per key/value head (``H = G·g``),
``R`` query rows and ``K`` keys of a tile, ``D``/``Dv`` head dims; ``X`` counts heads or blocks.

A tile's weights are recomputed from the whole attention's log-sum-exp, P = exp(s − lse), and
with dP = dO Vᵀ the gradient of the scores is dS = P ∘ (dP − rowsum(dO ∘ O)) (FlashAttention-2,
Dao 2023, arXiv:2307.08691, Algorithm 2). The bias enters the scores additively, so dS is its
gradient too, summed over the dimensions the bias broadcasts along so that it has the bias's own
shape. PyTorch's fused CPU backward returns dq, dk and dv but not dS: a tile whose bias needs a
gradient runs this backward instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def plain_tile_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    additive: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dS) of one tile: q (B, X, R, D), k (B, X, K, D), v (B, X, K, Dv), additive
    (B|1, X|1, R, K) or None; dS (B, X, R, K) in the accumulator dtype. ``out`` and ``lse`` are
    the whole attention's (a row with no visible key must carry a finite lse: its weights are 0
    through the mask)."""
    acc = acc_dtype(q.dtype)
    s = (q @ k.transpose(-2, -1)).to(acc).mul_(scale)
    if additive is not None:
        s = s.add_(additive.to(acc))
    p = s.sub_(lse.to(acc).unsqueeze(-1)).exp_()  # the weights, recomputed from the lse
    delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
    dv = p.to(dout.dtype).transpose(-2, -1) @ dout
    ds = p.mul_((dout @ v.transpose(-2, -1)).to(acc).sub_(delta))  # dS = P ∘ (dP − delta)
    dsq = (ds * scale).to(q.dtype)  # the scores are q kᵀ · scale
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
