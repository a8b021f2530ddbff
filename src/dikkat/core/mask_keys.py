"""Masks as cache keys: a hashable description of a mask, for the caches that hold work built
from it (the tiled backend's plans and tile masks, flex's block masks).

Shapes: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length (of the grids the
caches key on besides the mask).

A built-in mask is described by its type and fields, so two equal masks built apart share an
entry; a tensor field by :func:`tensor_identity` (where its values live, and its in-place
version), so an entry is never reused after the tensor changes. A mask type of the caller's own
may hold any state: it is described by its identity, and :func:`is_builtin` tells the caches not
to trust even that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import Tensor

from dikkat.core.mask_base import And, DenseMask, Mask, Not, Or
from dikkat.core.masks import Causal, Document, Full, Padding, PrefixLM, SlidingWindow

__all__ = ["BUILTIN_MASKS", "describe", "is_builtin", "tensor_identity"]

# Masks whose predicate depends on nothing but their fields (and is known to trace under flex).
BUILTIN_MASKS = frozenset(
    (And, Or, Not, Full, Causal, SlidingWindow, Padding, Document, PrefixLM, DenseMask)
)


def describe(obj: object, tensor: Callable[[Tensor], tuple]) -> tuple:
    """A hashable description of a mask (or bias), for caches keyed on it: built-in masks by
    type and fields, with ``tensor`` describing each tensor field; any other mask object by its
    identity (a cache entry must then hold the object, so that its id is not reused)."""
    if obj is None:
        return ()
    if isinstance(obj, Tensor):
        return ("tensor", *tensor(obj))
    if type(obj) in BUILTIN_MASKS:
        fields = (getattr(obj, f.name) for f in dataclasses.fields(obj))
        return (type(obj).__name__, *(_describe_field(v, tensor) for v in fields))
    return ("unknown", type(obj).__qualname__, id(obj))


def _describe_field(value: object, tensor: Callable[[Tensor], tuple]) -> object:
    return describe(value, tensor) if isinstance(value, (Tensor, Mask)) else value


def is_builtin(mask: Mask | None) -> bool:
    """Whether a mask is made of dikkat's own mask types all the way down, so that its
    parameters describe it; a mask type of the caller's own may hold any state."""

    def flat(description: tuple) -> list:
        out: list = []
        for item in description:
            out.extend(flat(item) if isinstance(item, tuple) else [item])
        return out

    return "unknown" not in flat(describe(mask, lambda t: ()))


def tensor_identity(t: Tensor) -> tuple:
    """Where the tensor's values live (storage, offset, shape, strides) and its in-place version:
    equal for two views of the same values (``ids`` and ``ids.unsqueeze(0)``), different once
    they change in place (views share the version counter). A cache entry keyed on it must hold
    the tensor, so that its memory is not freed and reused by another tensor meanwhile."""
    return (
        str(t.device),
        t.dtype,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t._version,
    )
