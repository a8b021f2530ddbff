"""Attention maps at fast-path cost: weights of chosen rows and heads from the saved log-sum-exp.

A fused or tiled backend never holds the (B, H, T, S) weights. With each row's log-sum-exp
``lse`` (``out, (_, lse) = dikkat.attention(..., return_lse=True)``) the weights of any rows are
one product away: ``α_ij = exp(q_i · k_j · scale + bias_ij − lse_i)`` over the allowed keys —
exactly the reference's softmax, for only the rows asked for. With ``softcap`` c the score is
capped first, ``c · tanh(q_i · k_j · scale / c)``, as in the attention call. With attention
sinks the lse counts them (the weights then sum to less than 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dikkat.core.checks import (
    broadcast_kv,
    check_bias,
    check_mask,
    check_qkv,
    check_scale,
    check_sinks,
    check_softcap,
)
from dikkat.core.masks import Mask


def _indices(
    name: str, value: Sequence[int] | Tensor | None, n: int, device: torch.device
) -> Tensor:
    if value is None:
        return torch.arange(n, device=device)
    idx = torch.as_tensor(value, device=device).long().flatten()
    if idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= n:
        raise ValueError(f"{name} must index 0 … {n - 1}, got {idx.tolist()}")
    return idx


def attention_weights(
    q: Tensor,
    k: Tensor,
    lse: Tensor | None,
    *,
    rows: Sequence[int] | Tensor | None = None,
    heads: Sequence[int] | Tensor | None = None,
    mask: Mask | Tensor | None = None,
    scale: float | None = None,
    bias: Tensor | None = None,
    q_offset: int = 0,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Weights (B, len(heads), len(rows), S) of the chosen query rows and heads.

    Args:
        q: (B, H, T, D), k: (B, G, S, D) or (1, G, S, D) — the attention call's inputs.
        lse: (B, H, T): ``aux.lse`` of ``out, aux = dikkat.attention(..., return_lse=True)``;
            None: each chosen row's log-sum-exp is computed from its scores (the same
            O(rows × S) work, for a backend that does not return it).
        rows, heads: query positions (0 … T − 1) and heads to compute; None = all.
        mask, scale, bias, q_offset, softcap: as in the attention call.
        sinks: the call's attention sinks, (H,) or 3-D broadcastable to (B, H, T); they enter
            the log-sum-exp computed when ``lse`` is None (a returned ``lse`` already counts
            them, and then they change nothing).
    """
    shape = check_qkv(q, k, k)
    k = broadcast_kv(k, shape.B)  # keys shared by the batch: a view
    if lse is not None and (
        not isinstance(lse, Tensor) or tuple(lse.shape) != (shape.B, shape.H, shape.T)
    ):
        raise ValueError(
            f"lse must have shape (B, H, T) = {(shape.B, shape.H, shape.T)}, "
            f"got {tuple(getattr(lse, 'shape', ()))}"
        )
    m = check_mask(mask, shape, q_offset)
    b4 = check_bias(bias, q, shape)
    scale = check_scale(scale, shape.D)
    softcap = check_softcap(softcap)
    sink = check_sinks(sinks, q, shape)  # (B|1, H|1, T|1)
    r = _indices("rows", rows, shape.T, q.device)
    h = _indices("heads", heads, shape.H, q.device)
    acc = torch.promote_types(q.dtype, torch.float32)
    qs = q[:, h][:, :, r].to(acc)  # (B, h, r, D)
    ks = k[:, h // shape.group].to(acc)  # the key/value head of each chosen query head
    scores = (qs @ ks.transpose(-2, -1)) * scale  # (B, h, r, S)
    if softcap is not None:  # capped before the bias, as dikkat.attention does
        scores = softcap * torch.tanh(scores / softcap)
    if b4 is not None:  # index the dims the bias has before broadcasting: never (B, H, T, S)
        bb = b4[:, h] if b4.shape[1] != 1 else b4
        bb = bb[:, :, r] if b4.shape[2] != 1 else bb
        scores = scores + bb.to(acc)
    if m is not None:  # the predicate on the chosen rows and heads only, never T × S
        allowed = m.evaluate(
            torch.arange(shape.B, device=q.device),
            h,
            r + q_offset,
            torch.arange(shape.S, device=q.device),
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
    if lse is None:
        row_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        if sink is not None:  # one more logit per row, in the denominator only
            sink = sink[:, h] if sink.shape[1] != 1 else sink
            sink = sink[:, :, r] if sink.shape[2] != 1 else sink
            row_lse = torch.logaddexp(row_lse, sink.to(acc).unsqueeze(-1))
    else:
        row_lse = lse[:, h][:, :, r].to(acc).unsqueeze(-1)
    # a row with no allowed key has lse = −inf: its weights are all 0
    return torch.exp(scores - row_lse.masked_fill(torch.isneginf(row_lse), float("inf")))
