"""Attention masks, written once as predicates and run by every backend.

Convention, everywhere in dikkat: **True = may attend.** (PyTorch's ``nn.MultiheadAttention`` and
``F.scaled_dot_product_attention`` disagree with each other here; see
:func:`from_torch_mask` for the conversion.)

Shapes: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length.

Every mask is a predicate ``mask(b, h, q_idx, kv_idx) -> bool`` evaluated on broadcastable integer
tensors. ``q_idx`` is the *absolute* position of a query: when decoding with a KV cache the queries
sit at positions ``q_offset … q_offset + T - 1`` while the keys run from 0 (a negative
``q_offset`` puts the first queries before key 0: bottom-right alignment when T > S, see
docs/attention.md "Causal masks when T ≠ S"; :func:`document` and :func:`prefix_lm` refuse it).
A backend may evaluate
the predicate on the whole (B, H, T, S) grid (:meth:`Mask.materialize`) or on one tile of it to
decide whether the tile can be skipped.

Masks combine with ``&`` and ``|`` (and ``~``); a boolean tensor broadcastable to (B, H, T, S)
is accepted wherever a mask is, and can be wrapped explicitly with :func:`dense`. The interface,
the combinators and dense masks are in :mod:`dikkat.core.mask_base` (re-exported here); this
module holds the mask shapes dikkat builds in.

>>> m = causal() & padding(torch.tensor([3, 2]))
>>> m.materialize(2, 1, 3, 3)[1, 0].int().tolist()
[[1, 0, 0], [1, 1, 0], [1, 1, 0]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.mask_base import (
    And,
    DenseMask,
    Mask,
    Not,
    Or,
    as_mask,
    kind_name,
    not_meta,
)
from dikkat.core.torch_masks import from_torch_mask

__all__ = [
    "And",
    "Causal",
    "DenseMask",
    "Document",
    "Full",
    "Mask",
    "Not",
    "Or",
    "Padding",
    "PrefixLM",
    "SlidingWindow",
    "as_mask",
    "causal",
    "dense",
    "document",
    "from_torch_mask",
    "full",
    "padding",
    "prefix_lm",
    "sliding_window",
]


@dataclass(frozen=True, eq=False)
class Full(Mask):
    """Every query sees every key: what an encoder does, and what a decoder must never do."""

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= 0) | (kv_idx >= 0)  # all True, broadcast to (1, 1, T, S)

    @property
    def is_full(self) -> bool:
        return True

    def kv_full_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        return 0, S


@dataclass(frozen=True, eq=False)
class Causal(Mask):
    """Position i sees keys 0 … i (the decoder's mask of Vaswani et al. 2017, §3.2.3)."""

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx >= kv_idx

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        return 0, max(0, min(S, q1))  # queries before key 0 (q_offset < 0) see none

    def kv_full_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        return 0, max(0, min(S, q0 + 1))  # keys up to the first query's own

    @property
    def is_causal(self) -> bool:
        return True


@dataclass(frozen=True, eq=False)
class SlidingWindow(Mask):
    """A band around the diagonal: the query at position i sees the keys j with
    ``i − window < j ≤ i + ahead`` — itself, the ``window − 1`` keys before it and the ``ahead``
    keys after it. ``ahead = 0`` (the default) is the causal sliding window of Mistral and
    Gemma; flash-attention's ``window_size=(left, right)`` is ``window = left + 1, ahead =
    right``."""

    window: int
    ahead: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "ahead"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")
        if self.ahead < 0:
            raise ValueError(
                f"ahead must be non-negative (the keys a query sees after its own position), "
                f"got {self.ahead}"
            )

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx - kv_idx
        return (distance >= -self.ahead) & (distance < self.window)

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        lo = max(0, q0 - self.window + 1)
        return lo, max(lo, min(S, q1 + self.ahead))

    def kv_full_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        # the last query's window starts latest, the first query's ends earliest
        lo = max(0, q1 - self.window)
        return lo, max(lo, min(S, q0 + self.ahead + 1))


def _batch_vector(name: str, value: Tensor | int, *, dtype_kind: str = "int") -> Tensor:
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.tensor([value])
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be an int or a tensor, got {type(value).__name__}")
    not_meta(name, value)
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name} must have shape (B,), got {tuple(value.shape)}")
    return value


def _check_batch(name: str, n: int, B: int) -> None:
    if n not in (1, B):
        raise ValueError(f"{name} has {n} entries but the batch has B={B}")


def _no_position_before_key_0(mask: str, q_offset: int) -> None:
    """Masks that give each query a place in a sequence (its document, whether it is in the
    prefix) have none for a query before key 0: a negative ``q_offset`` is refused, not guessed."""
    if q_offset < 0:
        raise ValueError(
            f"{mask}() places each query in the sequence of the keys, so it needs q_offset ≥ 0 "
            f"(a query before key 0 has no place there), got q_offset={q_offset}"
        )


@dataclass(frozen=True, eq=False)
class Padding(Mask):
    """Key padding: in sequence b only keys ``kv < lengths[b]`` (or marked in ``valid``) are real.

    Exactly one of ``lengths`` (B,) integers (right padding) and ``valid`` (B, S) bools (any
    layout, e.g. left padding for batched generation) is set.
    """

    lengths: Tensor | None = None
    valid: Tensor | None = None

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if self.lengths is not None:
            lengths = self.lengths.to(kv_idx.device)
            return kv_idx < lengths[b.clamp(max=lengths.numel() - 1)]
        valid = self.valid.to(kv_idx.device)  # (B, S)
        return valid[b.clamp(max=valid.shape[0] - 1), kv_idx.clamp(max=valid.shape[1] - 1)]

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        if self.lengths is None:
            return 0, S
        return 0, max(0, min(S, int(self.lengths.max())))

    def kv_full_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        if self.lengths is None:
            return 0, 0
        return 0, max(0, min(S, int(self.lengths.min())))  # real in every row

    def validate(self, B: int, H: int, T: int, S: int, q_offset: int = 0) -> None:
        if self.lengths is not None:
            _check_batch("padding lengths", self.lengths.numel(), B)
        else:
            _check_batch("padding valid", self.valid.shape[0], B)
            if self.valid.shape[1] != S:
                raise ValueError(
                    f"padding valid has shape {tuple(self.valid.shape)} but there are S={S} keys"
                )


@dataclass(frozen=True, eq=False)
class Document(Mask):
    """Packed sequences: attend only within the same document, causally.

    ``ids`` (B, N) or (N,) gives the document of every position, N ≥ q_offset + T and N ≥ S.
    """

    ids: Tensor

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        ids = self.ids.to(q_idx.device)
        rows = b.clamp(max=ids.shape[0] - 1)
        same = ids[rows, q_idx] == ids[rows, kv_idx]
        return same & (q_idx >= kv_idx)

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        hi = min(S, q1)
        ids = self.ids
        if q0 >= ids.shape[1] or not bool((ids[:, 1:] >= ids[:, :-1]).all()):
            return 0, hi  # documents not in order: only the causal bound holds
        # sorted ids: a query sees nothing before the first position of its own document
        starts = torch.searchsorted(ids.contiguous(), ids[:, q0 : q0 + 1].contiguous())
        return min(int(starts.min()), hi), hi

    def validate(self, B: int, H: int, T: int, S: int, q_offset: int = 0) -> None:
        _no_position_before_key_0("document", q_offset)
        _check_batch("document ids", self.ids.shape[0], B)
        needed = max(q_offset + T, S)
        if self.ids.shape[1] < needed:
            raise ValueError(
                f"document ids cover {self.ids.shape[1]} positions but queries reach position "
                f"{q_offset + T - 1} and keys position {S - 1}"
            )


@dataclass(frozen=True, eq=False)
class PrefixLM(Mask):
    """Prefix-LM: every position sees the whole prefix (``kv < prefix_len``), then causally."""

    prefix_len: Tensor

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        prefix = self.prefix_len.to(kv_idx.device)
        return (kv_idx < prefix[b.clamp(max=prefix.numel() - 1)]) | (q_idx >= kv_idx)

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        return 0, min(S, max(q1, int(self.prefix_len.max())))

    def validate(self, B: int, H: int, T: int, S: int, q_offset: int = 0) -> None:
        _no_position_before_key_0("prefix_lm", q_offset)
        _check_batch("prefix_len", self.prefix_len.numel(), B)


# --- constructors -------------------------------------------------------------------------------


def full() -> Mask:
    """No restriction: every query attends to every key (bidirectional)."""
    return Full()


def causal() -> Mask:
    """Causal mask: query position i attends to keys 0 … i."""
    return Causal()


def sliding_window(window: int, *, ahead: int = 0) -> Mask:
    """Sliding window: the query at position i attends to the keys j with
    ``i − window < j ≤ i + ahead``, i.e. keys i − window + 1 … i + ahead.

    With the default ``ahead = 0`` it is causal: ``window`` keys, the query's own and the
    ``window − 1`` before it (Mistral's and Gemma's ``sliding_window``). ``ahead > 0`` lets each
    query look ahead too, as flash-attention's ``window_size=(left, right)`` does: that is
    ``sliding_window(left + 1, ahead=right)``. (flash-attention's −1, an unbounded side, is a
    window longer than the keys: ``window ≥ q_offset + T``, ``ahead ≥ S``.) Positions are
    absolute, so with ``q_offset`` the band follows the queries' positions among the keys.

    >>> sliding_window(2, ahead=1).materialize(1, 1, 4, 4)[0, 0].int().tolist()
    [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    """
    return SlidingWindow(window, ahead)


def padding(lengths: Tensor | None = None, *, valid: Tensor | None = None) -> Mask:
    """Key padding mask from per-sequence ``lengths`` (B,) or a ``valid`` (B, S) bool tensor."""
    if (lengths is None) == (valid is None):
        raise ValueError("padding() takes exactly one of `lengths` and `valid`")
    if lengths is not None:
        lengths = _batch_vector("lengths", lengths)
        if bool((lengths < 0).any()):
            raise ValueError(f"lengths must be non-negative, got {lengths.tolist()}")
        return Padding(lengths=lengths)
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool:
        got = f"dtype {valid.dtype}" if isinstance(valid, Tensor) else kind_name(valid)
        raise TypeError(
            f"valid must be a bool tensor of shape (B, S) (True = real token), got {got}"
        )
    not_meta("valid", valid)
    if valid.dim() != 2:
        raise ValueError(f"valid must have shape (B, S), got {tuple(valid.shape)}")
    return Padding(valid=valid)


def document(ids: Tensor) -> Mask:
    """Packed documents: causal attention within each document; ``ids`` (B, N) or (N,)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"ids must be a tensor, got {type(ids).__name__}")
    not_meta("ids", ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ids must hold integer document ids, got dtype {ids.dtype}")
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise ValueError(f"ids must have shape (N,) or (B, N), got {tuple(ids.shape)}")
    return Document(ids)


def prefix_lm(prefix_len: Tensor | int) -> Mask:
    """Prefix-LM mask: bidirectional over the first ``prefix_len`` keys, causal after them."""
    prefix = _batch_vector("prefix_len", prefix_len)
    if (prefix < 0).any():
        raise ValueError(f"prefix_len must be non-negative, got {prefix.tolist()}")
    return PrefixLM(prefix)


def dense(tensor: Tensor, q_offset: int = 0) -> Mask:
    """Wrap a bool tensor broadcastable to (B, H, T, S) (True = may attend) as a mask."""
    return DenseMask(tensor, q_offset)
