"""What a model must offer to be generated from and served: the decoder protocol.

:func:`dikkat.generation.generate`, the pretrained wrapper and the serving engine
(:class:`dikkat.serving.Engine`, with its paged cache) depend on :class:`DecoderLM` alone, never
on a model class: ``dikkat.models.GPT`` and the Llama / Gemma family of
``dikkat.models.Decoder`` meet it, and so can a new family, without a change to either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict, runtime_checkable

import torch
from torch import Tensor
from typing_extensions import Unpack

from dikkat.core.masks import Mask
from dikkat.layers.kv_cache import AttendingCache, KVCache, SelfAttentionCache


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
    # the keys each layer sees, its own included (a sliding window), None where all; None: all
    windows: tuple[int | None, ...] | None = None

    def window(self, layer: int) -> int | None:
        """The keys layer ``layer`` sees (its own included), or None for every one."""
        return None if self.windows is None else self.windows[layer]


class LMConfig(Protocol):
    """The sizes generation checks its arguments against."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_len(self) -> int: ...


class ForwardOptions(TypedDict, total=False):
    """The keywords of a :class:`DecoderLM`'s forward (what each means: its docstring)."""

    valid: Tensor | None  # (B, T), False at padding
    offset: int  # the cache slot (and default position) of ids[:, 0]
    positions: Tensor | None  # (T,) or (B, T)
    cache: Sequence[KVCache | SelfAttentionCache] | None  # one per layer
    last_only: bool  # the last position's logits alone


class RunOptions(TypedDict, total=False):
    """The keywords of :meth:`LayeredLM.run`: the forward's, checked, without ``valid``; a
    cache may attend itself, and ``return_hidden`` gives the final hidden states."""

    offset: int
    positions: Tensor | None
    cache: Sequence[KVCache | SelfAttentionCache | AttendingCache] | None
    last_only: bool
    return_hidden: bool


class StaticDecodeStep(Protocol):
    """A decode step over a static cache: ``step(tokens, slot)`` feeds ``tokens`` (B,) at cache
    slot (and position) ``slot`` and returns their logits (B, V)."""

    def __call__(self, tokens: Tensor, slot: int) -> Tensor: ...


class PoolDecodeStep(Protocol):
    """A decode step over pools of slots: ``step(tokens, positions, slots)`` feeds ``tokens``
    (B,), row b at ``positions[b]``, its keys at pool slots ``slots[b, :]`` (B, S); returns the
    logits (B, V)."""

    def __call__(self, tokens: Tensor, positions: Tensor, slots: Tensor) -> Tensor: ...


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
      alone. Returns logits (B, T or 1, V);
    - :meth:`static_step`: one-token decode steps over ``cache`` (one :class:`KVCache` per
      layer, filled by a prefill), every row at one slot, ``compile=True`` through
      ``torch.compile`` (:func:`~dikkat.generation.generate` with ``compile=True``);
    - :meth:`pool_step`: one-token decode steps of rows at positions of their own, their keys
      and values in per-layer pools (N, G, D) of slots (the serving engine's paged cache).
    """

    @property
    def config(self) -> LMConfig: ...

    def cache_layout(self) -> CacheLayout: ...

    def new_cache(self, batch: int, max_len: int | None = None) -> list[KVCache]: ...

    def __call__(
        self, ids: Tensor, mask: Mask | Tensor | None = None, **options: Unpack[ForwardOptions]
    ) -> Tensor: ...

    def static_step(
        self, cache: Sequence[KVCache], *, compile: bool = False
    ) -> StaticDecodeStep: ...

    def pool_step(
        self, keys: Sequence[Tensor], values: Sequence[Tensor], *, compile: bool = False
    ) -> PoolDecodeStep: ...


class LayeredLM(DecoderLM, Protocol):
    """A :class:`DecoderLM` whose forward past its input checks can be run alone: what a decode
    step runs, its checks done outside (a compiled region reads no values on the host)."""

    def run(
        self, ids: Tensor, mask: Mask | Tensor | None, **options: Unpack[RunOptions]
    ) -> Tensor: ...
