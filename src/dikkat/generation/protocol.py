"""What a model must offer to be generated from and served: the decoder protocol.

:func:`dikkat.generation.generate`, the pretrained wrapper and the serving engine
(:class:`dikkat.serving.Engine`, with its paged cache) depend on :class:`DecoderLM` alone, never
on a model class: ``dikkat.models.GPT`` and the Llama / Gemma family of
``dikkat.models.Decoder`` meet it, and so can a new family, without a change to either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from dikkat.core.masks import Mask
from dikkat.layers.kv_cache import KVCache, SelfAttentionCache


@dataclass(frozen=True)
class CacheLayout:
    """What each layer's KV cache holds: (B, kv_heads, ≤ context, head_dim) keys and values of
    ``dtype`` on ``device``."""

    n_layers: int
    kv_heads: int
    head_dim: int
    context: int  # the longest sequence the model's positions allow
    dtype: torch.dtype
    device: torch.device


class LMConfig(Protocol):
    """The sizes generation checks its arguments against."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_len(self) -> int: ...


@runtime_checkable
class DecoderLM(Protocol):
    """A decoder-only language model, as generation and serving use it.

    - ``config.vocab_size``, ``config.max_len``: the sizes prompts are checked against;
    - :meth:`cache_layout`: the shape, dtype and device of each layer's keys and values;
    - :meth:`new_cache`: one preallocated cache per layer;
    - the forward: ``ids`` (B, T) at cache slots ``offset … offset + T − 1`` (or at their own
      ``positions`` (B, T)), attending through ``mask`` (default causal) to what ``cache``
      holds, each layer's keys and values written through ``cache[i].update(offset, k, v)``
      (:class:`~dikkat.layers.kv_cache.SelfAttentionCache`, which the paged cache implements);
      ``valid`` (B, T) marks left padding; ``last_only`` returns the last position's logits
      alone. Returns logits (B, T or 1, V).
    """

    @property
    def config(self) -> LMConfig: ...

    def cache_layout(self) -> CacheLayout: ...

    def new_cache(self, batch: int, max_len: int | None = None) -> list[KVCache]: ...

    def __call__(
        self,
        ids: Tensor,
        mask: Mask | Tensor | None = None,
        *,
        valid: Tensor | None = None,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: Sequence[KVCache | SelfAttentionCache] | None = None,
        last_only: bool = False,
    ) -> Tensor: ...
