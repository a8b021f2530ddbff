"""A preallocated KV cache: keys and values of past tokens, written in place, never re-grown
(docs/contract.md §7).

Notation: ``B`` batch, ``G`` key/value heads, ``S_max`` cache capacity, ``T`` new tokens,
``D`` head dim.

Decoding one token with the cache costs one row of scores against the S cached keys instead of
recomputing the whole (S, S) prefix; the prefill still pays the n² of docs/contract.md §6. With
grouped-query attention only G of the H heads are stored, so the cache is H/G times smaller
(docs/contract.md §17).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
from torch import Tensor, nn

from dikkat.validate import check_int


class SelfAttentionCache(Protocol):
    """What self-attention needs of a cache: write the new keys and values at slot ``start`` and
    return every slot to attend, ``(B, G, start + T, D)`` each.

    :class:`KVCache` is one; a cache that keeps its slots elsewhere (the paged pool of
    :mod:`dikkat.serving`, where each row's slots are scattered over fixed-size blocks) is
    another. The returned slots are the key positions that the attention mask and
    ``q_offset = start`` address, so such a cache lays them out as a contiguous view.
    """

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


class AttendingCache(ABC):
    """A layer's keys and values kept where a decode step keeps them, and the kernel that
    attends to them: handed to a self-attention layer as its ``cache``, it takes the place of
    the layer's ``cache.update`` and :func:`dikkat.attention` — the projections, q/k norms,
    RoPE and output projection around it stay the layer's own
    (:meth:`~dikkat.layers.MultiHeadAttention.forward`). The layer's mask and ``offset`` are
    not read: which slots a query sees is the cache's to say.

    :mod:`dikkat.models.static_step` keeps two: a static cache written at a position tensor,
    and pools of slots addressed by a block table.
    """

    @abstractmethod
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None
    ) -> Tensor:
        """Store the new keys and values k, v (B, G, T, D), then return softmax(q kᵀ · scale) v
        (B, H, T, D) for the queries q (B, H, T, D) over the slots each row sees; with
        ``softcap`` c, the scaled scores s soft-capped to c · tanh(s / c) first (Gemma 2)."""


class KVCache(nn.Module):
    """Keys and values of one attention layer, (B, G, S_max, D) each, filled from slot 0.

    >>> cache = KVCache(batch=1, n_kv_heads=2, max_len=16, head_dim=8)
    >>> k, v = cache.update(0, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))  # prefill
    >>> k, v = cache.update(5, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))  # one step
    >>> k.shape, cache.length
    (torch.Size([1, 2, 6, 8]), 6)
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch", batch),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ):
            check_int(name, value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.length = 0  # slots 0 … length−1 hold real keys

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the preallocated keys and values."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, G, T, D) into slots start … start+T−1; return all filled slots.

        Returns views (B, G, start+T, D) of the keys and values so far; writing at ``start`` below
        the current length overwrites (e.g. to reuse the cache for a new prompt).
        """
        ck, cv = self.k, self.v  # one buffer look-up each: this runs every layer, every token
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
        B, G, S_max, D = ck.shape
        if k.dim() != 4 or k.shape[0] != B or k.shape[1] != G or k.shape[3] != D:
            raise ValueError(
                f"cache holds (B, G, S_max, D) = {tuple(ck.shape)}; got k of shape {tuple(k.shape)}"
            )
        T = k.shape[2]
        check_int("start", start, at_least=0)
        if not 0 <= start <= self.length:
            raise ValueError(f"start={start} must lie in 0 … {self.length} (the filled length)")
        end = start + T
        if end > S_max:
            raise ValueError(
                f"cache is full: {end} tokens do not fit in its {S_max} slots "
                "(allocate a larger max_len)"
            )
        ck[:, :, start:end] = k
        cv[:, :, start:end] = v
        self.length = end
        return ck[:, :, :end], cv[:, :, :end]

    def reset(self) -> None:
        self.length = 0

    def extra_repr(self) -> str:
        return f"shape={tuple(self.k.shape)}, dtype={self.k.dtype}, length={self.length}"
