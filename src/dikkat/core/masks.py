"""Attention masks, written once as predicates and run by every backend.

Convention, everywhere in dikkat: **True = may attend.** (PyTorch's ``nn.MultiheadAttention`` and
``F.scaled_dot_product_attention`` disagree with each other here; see
:func:`from_torch_mask` for the conversion.)

Shapes: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length.

Every mask is a predicate ``mask(b, h, q_idx, kv_idx) -> bool`` evaluated on broadcastable integer
tensors. ``q_idx`` is the *absolute* position of a query: when decoding with a KV cache the queries
sit at positions ``q_offset … q_offset + T - 1`` while the keys run from 0. A backend may evaluate
the predicate on the whole (B, H, T, S) grid (:meth:`Mask.materialize`) or on one tile of it to
decide whether the tile can be skipped.

Masks combine with ``&`` and ``|`` (and ``~``); a boolean tensor broadcastable to (B, H, T, S)
is accepted wherever a mask is, and can be wrapped explicitly with :func:`dense`.

>>> m = causal() & padding(torch.tensor([3, 2]))
>>> m.materialize(2, 1, 3, 3)[1, 0].int().tolist()
[[1, 0, 0], [1, 1, 0], [1, 1, 0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

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


def _kind(value: object) -> str:
    """How an error names a value's type (numpy's arrays by their module too)."""
    cls = type(value)
    return f"numpy.{cls.__name__}" if cls.__module__ == "numpy" else cls.__name__


def _numpy_hint(value: object) -> str:
    return " (torch.from_numpy converts a numpy array)" if type(value).__module__ == "numpy" else ""


def _operand(other: object, op: str) -> Mask:
    """The other side of ``mask & other`` / ``mask | other``: a Mask or a bool tensor, never None
    (which would build a mask that fails only when it is evaluated)."""
    if not isinstance(other, (Mask, Tensor)):
        raise TypeError(
            f"the other operand of `{op}` with a mask must be a dikkat Mask or a bool tensor, "
            f"got {_kind(other)}{_numpy_hint(other)}"
        )
    return as_mask(other)  # type: ignore[return-value]


def _check_parts(combinator: str, *parts: object) -> None:
    for part in parts:
        if not isinstance(part, Mask):
            raise TypeError(f"{combinator} combines dikkat Masks, got {_kind(part)}")


def _not_meta(name: str, t: Tensor) -> None:
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
class Full(Mask):
    """Every query sees every key: what an encoder does, and what a decoder must never do."""

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= 0) | (kv_idx >= 0)  # all True, broadcast to (1, 1, T, S)

    @property
    def is_full(self) -> bool:
        return True


@dataclass(frozen=True, eq=False)
class Causal(Mask):
    """Position i sees keys 0 … i (the seed's −∞ above the diagonal)."""

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx >= kv_idx

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        return 0, min(S, q1)

    @property
    def is_causal(self) -> bool:
        return True


@dataclass(frozen=True, eq=False)
class SlidingWindow(Mask):
    """Causal, and position i sees itself and the ``window - 1`` keys before it."""

    window: int

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int):
            raise TypeError(f"window must be an int, got {type(self.window).__name__}")
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance < self.window)

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        return max(0, q0 - self.window + 1), min(S, q1)


def _batch_vector(name: str, value: Tensor | int, *, dtype_kind: str = "int") -> Tensor:
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.tensor([value])
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be an int or a tensor, got {type(value).__name__}")
    _not_meta(name, value)
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name} must have shape (B,), got {tuple(value.shape)}")
    return value


def _check_batch(name: str, n: int, B: int) -> None:
    if n not in (1, B):
        raise ValueError(f"{name} has {n} entries but the batch has B={B}")


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
        _check_batch("prefix_len", self.prefix_len.numel(), B)


@dataclass(frozen=True, eq=False)
class DenseMask(Mask):
    """Any bool tensor broadcastable to (B, H, T, S); its rows are the queries as passed.

    ``q_offset`` is the absolute position of row 0 (the attention call sets it when it wraps a
    plain tensor), so a dense mask composes with the absolute-position predicates.
    """

    tensor: Tensor
    q_offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, Tensor):
            raise TypeError(
                f"mask must be a Mask or a bool tensor, got {_kind(self.tensor)}"
                + _numpy_hint(self.tensor)
            )
        _not_meta("mask tensor", self.tensor)
        if isinstance(self.q_offset, bool) or not isinstance(self.q_offset, int):
            raise TypeError(f"q_offset must be an int, got {type(self.q_offset).__name__}")
        if self.q_offset < 0:
            raise ValueError(f"q_offset must be non-negative, got {self.q_offset}")
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


# --- constructors -------------------------------------------------------------------------------


# Masks whose predicate depends on nothing but their fields (and is known to trace under flex).
_BUILTIN_MASKS = frozenset(
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
    if type(obj) in _BUILTIN_MASKS:
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


def full() -> Mask:
    """No restriction: every query attends to every key (bidirectional)."""
    return Full()


def causal() -> Mask:
    """Causal mask: query position i attends to keys 0 … i."""
    return Causal()


def sliding_window(window: int) -> Mask:
    """Causal sliding window: query i attends to keys i − window + 1 … i (``window`` keys)."""
    return SlidingWindow(window)


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
        got = f"dtype {valid.dtype}" if isinstance(valid, Tensor) else _kind(valid)
        raise TypeError(
            f"valid must be a bool tensor of shape (B, S) (True = real token), got {got}"
        )
    _not_meta("valid", valid)
    if valid.dim() != 2:
        raise ValueError(f"valid must have shape (B, S), got {tuple(valid.shape)}")
    return Padding(valid=valid)


def document(ids: Tensor) -> Mask:
    """Packed documents: causal attention within each document; ``ids`` (B, N) or (N,)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"ids must be a tensor, got {type(ids).__name__}")
    _not_meta("ids", ids)
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


def as_mask(mask: Mask | Tensor | None, q_offset: int = 0) -> Mask | None:
    """Accept a :class:`Mask`, a bool tensor, or None."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        return DenseMask(mask, q_offset)
    raise TypeError(
        f"mask must be a dikkat Mask, a bool tensor or None, got {_kind(mask)}{_numpy_hint(mask)}"
    )


from dikkat.core.torch_masks import from_torch_mask  # noqa: E402 — re-exported here
