"""The mask interface: a predicate on (batch, head, query, key), its algebra, and bool tensors.

Convention, everywhere in dikkat: **True = may attend.**

Shapes: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length.

:class:`Mask` is what every backend reads: a predicate evaluated on broadcastable index tensors,
with a conservative key range per run of queries (:meth:`Mask.kv_range`). Masks combine with
``&``, ``|`` and ``~`` (:class:`And`, :class:`Or`, :class:`Not`); a bool tensor broadcastable to
(B, H, T, S) is a mask too (:class:`DenseMask`, :func:`as_mask`). The built-in mask shapes
(causal, sliding window, padding, packed documents, prefix-LM) are in :mod:`dikkat.core.masks`,
which re-exports everything here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["And", "DenseMask", "Mask", "Not", "Or", "as_mask"]


class Mask:
    """A predicate on (batch, head, absolute query position, key position)."""

    # numpy would otherwise run ``array & mask`` element by element, handing each numpy bool to
    # __rand__; with this it defers to __rand__ once, with the whole array, which refuses it.
    __array_ufunc__ = None

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """A bool tensor broadcast from the index tensors: True where attention is allowed."""
        raise NotImplementedError

    def validate(self, B: int, H: int, T: int, S: int, q_offset: int = 0) -> None:
        """Raise ``ValueError`` if this mask cannot apply to a (B, H, T, S) score grid."""

    def materialize(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q_offset: int = 0,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """The dense bool mask, broadcastable to (B, H, T, S).

        Dimensions the predicate does not depend on stay of size 1 (a causal mask is (1, 1, T, S)).
        """
        self.validate(B, H, T, S, q_offset)
        return self.evaluate(
            torch.arange(B, device=device),
            torch.arange(H, device=device),
            torch.arange(q_offset, q_offset + T, device=device),
            torch.arange(S, device=device),
        )

    def evaluate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The predicate on the grid of 1-D index vectors (batches, heads, absolute query
        positions, key positions), as a 4-D bool tensor broadcastable to their lengths."""
        out = self.predicate(
            b.view(-1, 1, 1, 1),
            h.view(1, -1, 1, 1),
            q_idx.view(1, 1, -1, 1),
            kv_idx.view(1, 1, 1, -1),
        )
        return out.view((1,) * (4 - out.dim()) + tuple(out.shape)) if out.dim() < 4 else out

    @property
    def is_causal(self) -> bool:
        """True only for the plain causal mask (lets a backend use a dedicated causal kernel)."""
        return False

    @property
    def is_full(self) -> bool:
        """True only for :func:`full`: nothing is masked, so backends may skip the mask."""
        return False

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        """Keys ``lo … hi − 1`` hold every key that queries at absolute positions q0 … q1 − 1
        may see (a conservative bound), so a tiled backend need not even look at the rest."""
        return 0, S

    def kv_full_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        """Keys ``lo … hi − 1`` that every query at absolute positions q0 … q1 − 1 sees, in
        every batch row and head (a conservative bound: fewer is always right; ``lo >= hi``:
        none known), so a tiled backend runs them without a mask. Default: none."""
        return 0, 0

    def __and__(self, other: Mask | Tensor) -> Mask:
        return And(self, _operand(other, "&"))

    def __rand__(self, other: Tensor) -> Mask:
        return And(_operand(other, "&"), self)

    def __or__(self, other: Mask | Tensor) -> Mask:
        return Or(self, _operand(other, "|"))

    def __ror__(self, other: Tensor) -> Mask:
        return Or(_operand(other, "|"), self)

    def __invert__(self) -> Mask:
        return Not(self)


def kind_name(value: object) -> str:
    """How an error names a value's type (numpy's arrays by their module too)."""
    cls = type(value)
    return f"numpy.{cls.__name__}" if cls.__module__ == "numpy" else cls.__name__


def numpy_hint(value: object) -> str:
    return " (torch.from_numpy converts a numpy array)" if type(value).__module__ == "numpy" else ""


def _operand(other: object, op: str) -> Mask:
    """The other side of ``mask & other`` / ``mask | other``: a Mask or a bool tensor, never None
    (which would build a mask that fails only when it is evaluated)."""
    if not isinstance(other, (Mask, Tensor)):
        raise TypeError(
            f"the other operand of `{op}` with a mask must be a dikkat Mask or a bool tensor, "
            f"got {kind_name(other)}{numpy_hint(other)}"
        )
    return as_mask(other)  # type: ignore[return-value]


def _check_parts(combinator: str, *parts: object) -> None:
    for part in parts:
        if not isinstance(part, Mask):
            raise TypeError(f"{combinator} combines dikkat Masks, got {kind_name(part)}")


def not_meta(name: str, t: Tensor) -> None:
    if t.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds no values: a mask needs them to say which "
            f"keys each query may see (got a meta tensor of shape {tuple(t.shape)})"
        )


@dataclass(frozen=True, eq=False)
class And(Mask):
    left: Mask
    right: Mask

    def __post_init__(self) -> None:
        _check_parts("And", self.left, self.right)

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.left.predicate(b, h, q_idx, kv_idx) & self.right.predicate(b, h, q_idx, kv_idx)

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        (a, b), (c, d) = self.left.kv_range(q0, q1, S), self.right.kv_range(q0, q1, S)
        return max(a, c), min(b, d)

    def kv_full_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        (a, b) = self.left.kv_full_range(q0, q1, S)
        (c, d) = self.right.kv_full_range(q0, q1, S)
        return max(a, c), min(b, d)  # seen by both parts

    def validate(self, B: int, H: int, T: int, S: int, q_offset: int = 0) -> None:
        self.left.validate(B, H, T, S, q_offset)
        self.right.validate(B, H, T, S, q_offset)


@dataclass(frozen=True, eq=False)
class Or(Mask):
    left: Mask
    right: Mask

    def __post_init__(self) -> None:
        _check_parts("Or", self.left, self.right)

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.left.predicate(b, h, q_idx, kv_idx) | self.right.predicate(b, h, q_idx, kv_idx)

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        (a, b), (c, d) = self.left.kv_range(q0, q1, S), self.right.kv_range(q0, q1, S)
        return min(a, c), max(b, d)

    def kv_full_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        (a, b) = self.left.kv_full_range(q0, q1, S)
        (c, d) = self.right.kv_full_range(q0, q1, S)
        if a < b and c < d and max(a, c) <= min(b, d):  # overlapping or touching: the union
            return min(a, c), max(b, d)
        return (a, b) if b - a >= d - c else (c, d)  # seen through either part: the longer

    def validate(self, B: int, H: int, T: int, S: int, q_offset: int = 0) -> None:
        self.left.validate(B, H, T, S, q_offset)
        self.right.validate(B, H, T, S, q_offset)


@dataclass(frozen=True, eq=False)
class Not(Mask):
    inner: Mask

    def __post_init__(self) -> None:
        _check_parts("Not", self.inner)

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~self.inner.predicate(b, h, q_idx, kv_idx)

    def validate(self, B: int, H: int, T: int, S: int, q_offset: int = 0) -> None:
        self.inner.validate(B, H, T, S, q_offset)


@dataclass(frozen=True, eq=False)
class DenseMask(Mask):
    """Any bool tensor broadcastable to (B, H, T, S); its rows are the queries as passed.

    ``q_offset`` is the absolute position of row 0 (the attention call sets it when it wraps a
    plain tensor), so a dense mask composes with the absolute-position predicates; negative
    when the first rows sit before key 0.
    """

    tensor: Tensor
    q_offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, Tensor):
            raise TypeError(
                f"mask must be a Mask or a bool tensor, got {kind_name(self.tensor)}"
                + numpy_hint(self.tensor)
            )
        not_meta("mask tensor", self.tensor)
        if isinstance(self.q_offset, bool) or not isinstance(self.q_offset, int):
            raise TypeError(f"q_offset must be an int, got {type(self.q_offset).__name__}")
        if self.tensor.dtype != torch.bool:
            raise TypeError(
                f"mask tensor must be bool (True = may attend), got dtype {self.tensor.dtype}; "
                "pass an additive float mask as `bias` instead"
            )
        if not 1 <= self.tensor.dim() <= 4:
            raise ValueError(
                f"mask tensor must have 1 to 4 dims broadcastable to (B, H, T, S), "
                f"got shape {tuple(self.tensor.shape)}"
            )

    def _as4d(self) -> Tensor:
        t = self.tensor
        return t.view((1,) * (4 - t.dim()) + tuple(t.shape))

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        t = self._as4d().to(q_idx.device)
        idx = (b, h, q_idx - self.q_offset, kv_idx)
        # A size-1 dimension broadcasts: every index maps to its one entry.
        idx = tuple(i if n > 1 else torch.zeros_like(i) for i, n in zip(idx, t.shape, strict=True))
        return t[idx]

    def validate(self, B: int, H: int, T: int, S: int, q_offset: int = 0) -> None:
        shape = tuple(self._as4d().shape)
        target = (B, H, T, S)
        if any(n not in (1, m) for n, m in zip(shape, target, strict=True)):
            raise ValueError(
                f"mask of shape {tuple(self.tensor.shape)} does not broadcast to the "
                f"(B, H, T, S) = {target} scores"
            )
        if shape[2] > 1 and q_offset != self.q_offset:
            raise ValueError(
                f"dense mask rows start at query position {self.q_offset}, but the queries start "
                f"at {q_offset}"
            )

    def materialize(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q_offset: int = 0,
        device: torch.device | str | None = None,
    ) -> Tensor:
        self.validate(B, H, T, S, q_offset)
        return self._as4d().to(device) if device is not None else self._as4d()


def as_mask(mask: Mask | Tensor | None, q_offset: int = 0) -> Mask | None:
    """Accept a :class:`Mask`, a bool tensor, or None."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        return DenseMask(mask, q_offset)
    raise TypeError(
        f"mask must be a dikkat Mask, a bool tensor or None, got "
        f"{kind_name(mask)}{numpy_hint(mask)}"
    )
