"""Scaled dot-product attention written out: ``softmax(Q Kᵀ / √d_k) V`` (Vaswani et al. 2017,
"Attention Is All You Need", arXiv:1706.03762, eq. 1). This is the oracle.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` query length, ``S`` key
length, ``D`` head dim, ``Dv`` value head dim.

Every faster backend is tested against this function run in float64. It computes in the dtype of
its inputs (so in bf16 it shows how much error a plain bf16 implementation makes, which is the
yardstick of the 2× error rule), except that a bias is added in its own dtype (fp32 for bf16 q:
:func:`dikkat.core.checks.bias_dtype`), materialises the full (B, H, T, S) score matrix and
returns the weights. NaN and ±∞ in the inputs: this is the plain formula (a NaN value row reaches
every row through 0 · NaN); ``dikkat.attention`` applies the rule of :mod:`dikkat.core.attention`
around it, as around every backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dikkat.core.checks import row_sinks
from dikkat.core.masks import Mask
from dikkat.core.outputs import AttentionAux


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """(B, G, S, D) → (B, G·group, S, D): kv head g serves query heads g·group … (g+1)·group − 1."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None = None,
    *,
    scale: float,
    bias: Tensor | None = None,
    q_offset: int = 0,
    dropout: float = 0.0,
    return_lse: bool = False,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, AttentionAux]:
    """Attention(Q, K, V) = softmax(Q Kᵀ · scale + bias, masked) V, with its weights.

    Args:
        q: (B, H, T, D); k: (B, G, S, D); v: (B, G, S, Dv), G dividing H (k and v of batch
            size 1 broadcast against q's, through the matmuls).
        mask: True = may attend; masked scores become −inf, so exp(−inf) = 0.
        scale: multiplies the scores (1/√D in eq. 1 of the paper).
        bias: additive scores, broadcastable to (B, H, T, S); the scores are cast to its dtype
            before it is added (so an fp32 bias with bf16 q is added, and softmaxed, in fp32).
        q_offset: absolute position of the first query (for masks, when decoding with a cache;
            negative when the first queries sit before key 0).
        dropout: probability of dropping a weight before it multiplies V (training only).
        return_lse: also return each row's log-sum-exp of the scores (B, H, T), in fp32 (fp64
            for fp64 inputs).
        softcap: when set, the scaled scores s become ``softcap · tanh(s / softcap)`` before
            the bias and the mask, in this order as Gemma 2's attention does (transformers,
            ``models/gemma2/modeling_gemma2.py``, ``eager_attention_forward``).
        sinks: attention sinks, (H,) or 3-D broadcastable to (B, H, T): one more logit per row,
            in the softmax's denominator only (a column of scores whose value is 0), as gpt-oss
            learns one per head (transformers, ``models/gpt_oss/modeling_gpt_oss.py``,
            ``eager_attention_forward``). The lse counts it.

    Returns:
        ``(out, aux)``: out (B, H, T, Dv) and an :class:`~dikkat.core.outputs.AttentionAux`
        whose ``weights`` (B, H, T, S) are always there (this function holds them) and whose
        ``lse`` is None unless ``return_lse``. Each row of weights is ≥ 0 and sums to 1, except
        a row whose every key is masked, which is all 0 (and its output 0, never NaN). With
        ``sinks`` each row sums to 1 − exp(sink − lse), and a row with no allowed key puts all
        its weight on the sink (weights 0, output 0).
    """
    B, H, T, _ = q.shape
    S = k.shape[2]
    group = H // k.shape[1]
    k, v = repeat_kv(k, group), repeat_kv(v, group)  # (B, H, S, D), (B, H, S, Dv)

    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S): q_i · k_j / √d_k
    if softcap is not None:  # bounded to (−softcap, softcap); the lse is of the capped scores
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:  # added in the bias's dtype (fp32 for bf16 q, see checks.bias_dtype)
        scores = scores.to(torch.promote_types(scores.dtype, bias.dtype)) + bias
    if mask is not None:
        allowed = mask.materialize(B, H, T, S, q_offset, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # the sink as a column (S + 1) of the softmax, dropped after it
        sink = row_sinks(sinks)  # (B|1, H|1, T|1)
        scores = scores.to(torch.promote_types(scores.dtype, sink.dtype))
        column = sink.to(scores.dtype).unsqueeze(-1).expand(B, H, T, 1)
        scores = torch.cat([scores, column], dim=-1)  # (B, H, T, S + 1); the sink is finite
        weights = torch.softmax(scores, dim=-1)[..., :S]
    else:
        # A row with every key masked would be softmax(−inf, …, −inf) = 0/0. Give it finite
        # scores for the softmax and zero weights after it, so its output is 0 and its gradients
        # are finite.
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (B, H, T, 1)
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    weights = weights.to(q.dtype)  # a plain implementation in q's dtype from here on
    dropped = F.dropout(weights, p=dropout) if dropout > 0 else weights
    lse = None
    if return_lse:  # −inf for a row with no allowed key (and no sink)
        lse_dtype = torch.promote_types(scores.dtype, torch.float32)  # fp32, or fp64 for fp64
        lse = torch.logsumexp(scores.to(lse_dtype), dim=-1)
    return dropped @ v, AttentionAux(weights, lse)
