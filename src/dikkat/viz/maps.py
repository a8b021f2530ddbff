"""What the attention pictures draw: :class:`AttentionMaps`, weights with their token labels.

Notation: ``L`` layers, ``H`` heads, ``Tq`` query rows, ``Tk`` keys.

Whoever collects weights (``dikkat.capture`` on a dikkat or Hugging Face model) fills one of
these; the heat-map figures and the HTML report only read it, so drawing never needs a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MEAN_OF_HEADS", "AttentionMaps", "spread"]

KINDS = ("self", "cross", "image")

# the head number of a map averaged over every head (attention rollout, arXiv:2005.00928)
MEAN_OF_HEADS = -1


@dataclass(frozen=True, eq=False)
class AttentionMaps:
    """Attention weights to draw: one (Tq, Tk) matrix per kept layer and head.

    ``weights[l, h, i, j]`` is how much query row ``i`` (the token ``queries[i]``, at position
    ``rows[i]`` of the input) of head ``heads[h]`` in layer ``layers[l]`` attends to key ``j``
    (the token ``keys[j]``). Each row sums to 1, or is all 0 for a query that sees no key.
    """

    queries: tuple[str, ...]  # a label per query row
    keys: tuple[str, ...]  # a label per key
    layers: tuple[str, ...]  # a label per layer kept ("layer 0", or a module name)
    heads: tuple[int, ...]  # the head numbers kept
    weights: np.ndarray  # (L, H, Tq, Tk) float32
    rows: tuple[int, ...] | None = None  # input positions of the query rows; None: 0 … Tq − 1
    kind: str = "self"  # "self" (a sequence over itself), "cross" (target over source), "image"
    title: str = ""

    def __post_init__(self) -> None:
        w = self.weights
        if not isinstance(w, np.ndarray) or w.ndim != 4:
            raise ValueError(
                f"weights must be a 4-D numpy array (L, H, Tq, Tk), got {type(w).__name__} "
                f"of shape {getattr(w, 'shape', None)}"
            )
        L, H, Tq, Tk = w.shape
        for name, labels, n in (
            ("layers", self.layers, L),
            ("heads", self.heads, H),
            ("queries", self.queries, Tq),
            ("keys", self.keys, Tk),
        ):
            if len(labels) != n:
                raise ValueError(
                    f"{name} has {len(labels)} labels but weights {tuple(w.shape)} has {n} along "
                    "its axis"
                )
        if self.rows is not None and len(self.rows) != Tq:
            raise ValueError(f"rows has {len(self.rows)} positions but weights has {Tq} rows")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not np.isfinite(w).all() or (w < 0).any():
            raise ValueError("weights must be finite and non-negative")

    def pick(self, layers: Sequence[int] | None = None, heads: Sequence[int] | None = None
             ) -> AttentionMaps:  # fmt: skip
        """These maps with only the kept layers and heads at the indices ``layers`` and
        ``heads`` (indices into :attr:`layers` and :attr:`heads`; None keeps all)."""
        L, H = self.weights.shape[:2]
        li = list(range(L)) if layers is None else [range(L)[i] for i in layers]
        hi = list(range(H)) if heads is None else [range(H)[i] for i in heads]
        return dataclasses.replace(
            self,
            layers=tuple(self.layers[i] for i in li),
            heads=tuple(self.heads[i] for i in hi),
            weights=self.weights[li][:, hi],
        )

    @property
    def query_positions(self) -> tuple[int, ...]:
        """The input position of each query row."""
        return tuple(range(self.weights.shape[2])) if self.rows is None else self.rows

    @property
    def head_labels(self) -> tuple[str, ...]:
        """A label per kept head: ``"head 3"``, or ``"mean of heads"`` for :data:`MEAN_OF_HEADS`."""
        return tuple("mean of heads" if h == MEAN_OF_HEADS else f"head {h}" for h in self.heads)


def spread(n: int, k: int) -> list[int]:
    """``k`` indices of ``range(n)`` spread evenly, the first and the last among them (all of
    them where ``n <= k``): the layers a picture of a deep model shows by default."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
