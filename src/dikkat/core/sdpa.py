"""PyTorch's fused ``F.scaled_dot_product_attention`` as a dikkat backend.

Differences from the reference: no weights; a dikkat mask is handed over as SDPA's ``is_causal``
flag when it is the plain causal mask at offset 0 (or a causal sliding window wider than every
query's distance to key 0, which then hides nothing more), otherwise materialised as a dense
bool mask (or folded into a float mask when there is a bias); fully masked rows are opened for
the kernel and their outputs zeroed afterwards, so they give 0 and finite gradients like every
backend. A bias is handed over in fp32 (fp64 for fp64 q) on CPU, in q's dtype elsewhere; its
gradient is SDPA's own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dikkat.core.masks import Causal, Mask, SlidingWindow
from dikkat.core.reference import repeat_kv
from dikkat.core.tracing import tracing

# ``enable_gqa`` arrived in torch 2.5; before it, key/value heads are repeated by hand.
_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
CAUSAL = Causal()
# torch's own function, held here: a user may assign dikkat.functional's drop-in to
# torch.nn.functional.scaled_dot_product_attention, and this backend must not call back into it
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None = None,
    *,
    scale: float,
    bias: Tensor | None = None,
    q_offset: int = 0,
    dropout: float = 0.0,
) -> Tensor:
    """Attention through ``F.scaled_dot_product_attention``; shapes as in the reference."""
    B, H, T, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    kwargs: dict = {"dropout_p": dropout, "scale": scale}
    if G != H:
        if _HAS_GQA:
            kwargs["enable_gqa"] = True
        else:  # torch < 2.5
            k, v = repeat_kv(k, H // G), repeat_kv(v, H // G)

    if isinstance(mask, SlidingWindow) and mask.ahead == 0 and q_offset + T - 1 < mask.window:
        mask = CAUSAL  # every query's window reaches back past key 0: it hides what causal does
    if mask is not None and mask.is_causal and q_offset >= S - 1:
        mask = None  # every query sits at or after the last key: the causal mask hides nothing
    if bias is None and (mask is None or (mask.is_causal and q_offset == 0)):
        # SDPA's causal flag aligns query 0 with key 0, which is our causal mask at offset 0.
        return TORCH_SDPA(q, k, v, is_causal=mask is not None, **kwargs)

    allowed = None if mask is None else mask.materialize(B, H, T, S, q_offset, q.device)
    if bias is None:
        attn_mask = allowed  # bool, True = may attend: SDPA's convention too
        empty = None if allowed is None else ~allowed.any(dim=-1, keepdim=True)
    else:
        # On CPU SDPA takes an fp32 float mask with bf16/fp16 q and adds it in fp32 (checked with
        # torch 2.13). Elsewhere it is cast to q's dtype: whether CUDA's fused kernels accept a
        # wider mask (rather than falling back to the math kernel) is not checked here.
        attn_mask = bias if q.device.type == "cpu" else bias.to(q.dtype)
        if allowed is not None:
            attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
        empty = torch.isneginf(attn_mask).all(dim=-1, keepdim=True)

    if empty is not None and (tracing() or bool(empty.any())):  # traced: no branch on values
        # Open fully masked rows (else the kernel may return NaN) and zero them afterwards.
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask | empty
        else:
            attn_mask = attn_mask.masked_fill(empty, 0.0)
        out = TORCH_SDPA(q, k, v, attn_mask=attn_mask, **kwargs)
        return out.masked_fill(empty, 0.0)
    return TORCH_SDPA(q, k, v, attn_mask=attn_mask, **kwargs)
