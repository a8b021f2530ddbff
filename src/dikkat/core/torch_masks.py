"""PyTorch's attention masks → dikkat's (PyTorch's ``nn.MultiheadAttention`` means the opposite).

dikkat: **True = may attend**. ``nn.MultiheadAttention``: a True entry is *blocked*; its float
masks are additive (0 allowed, −inf blocked).
"""

from __future__ import annotations

import torch
from torch import Tensor


def from_torch_mask(
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    *,
    n_heads: int | None = None,
) -> Tensor | None:
    """Convert the masks of ``torch.nn.MultiheadAttention`` into a dikkat bool mask.

    PyTorch's MHA means the opposite of dikkat: a True entry there is *blocked*. Float masks there
    are additive; only 0 (allowed) and −inf (blocked) convert to a bool mask.

    Args:
        attn_mask: (T, S) or (B·n_heads, T, S), bool (True = blocked) or float (additive).
        key_padding_mask: (B, S), bool (True = padding, ignored) or float (additive).
        n_heads: needed to unfold a 3-D ``attn_mask``.

    Returns:
        A bool tensor broadcastable to (B, H, T, S), True = may attend; None if both are None.
    """
    if n_heads is not None:
        if isinstance(n_heads, bool) or not isinstance(n_heads, int):
            raise TypeError(f"n_heads must be an int or None, got {type(n_heads).__name__}")
        if n_heads <= 0:
            raise ValueError(f"n_heads must be positive, got {n_heads}")
    out: Tensor | None = None
    if attn_mask is not None:
        allowed = _torch_allowed("attn_mask", attn_mask)
        if allowed.dim() == 2:
            allowed = allowed.view(1, 1, *allowed.shape)
        elif allowed.dim() == 3:
            if n_heads is None or allowed.shape[0] % n_heads:
                raise ValueError(
                    f"a 3-D attn_mask of shape {tuple(attn_mask.shape)} needs n_heads dividing "
                    f"its first dim, got n_heads={n_heads}"
                )
            allowed = allowed.view(-1, n_heads, *allowed.shape[1:])
        else:
            raise ValueError(
                f"attn_mask must have shape (T, S) or (B*n_heads, T, S), "
                f"got {tuple(attn_mask.shape)}"
            )
        out = allowed
    if key_padding_mask is not None:
        keep = _torch_allowed("key_padding_mask", key_padding_mask)
        if keep.dim() != 2:
            raise ValueError(f"key_padding_mask must have shape (B, S), got {tuple(keep.shape)}")
        keep = keep.view(keep.shape[0], 1, 1, keep.shape[1])
        out = keep if out is None else out & keep
    return out


def _torch_allowed(name: str, m: Tensor) -> Tensor:
    if not isinstance(m, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(m).__name__}")
    if m.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values to convert")
    if m.dtype == torch.bool:
        return ~m
    if m.dtype.is_floating_point:
        blocked = torch.isneginf(m)
        if not ((m == 0) | blocked).all():
            raise ValueError(
                f"{name} holds additive values other than 0 and -inf; pass it as `bias` instead"
            )
        return ~blocked
    raise TypeError(f"{name} must be bool or float, got dtype {m.dtype}")
