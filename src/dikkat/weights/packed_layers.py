"""Layers holding :class:`~dikkat.weights.packed.PackedWeight`: a linear layer (its parts stacked
by rows, as a GGUF file may quantise a fused projection's parts differently) and a token
embedding, which a tied output layer shares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.weights.groups import ROWS
from dikkat.weights.held import HeldWeight, InferenceLinear
from dikkat.weights.packed import PackedWeight, dequantize, packed_linear

__all__ = ["PackedEmbedding", "PackedLinear"]


class PackedLinear(InferenceLinear):
    """A linear layer holding its weight as :class:`PackedWeight` row blocks: the product of
    :func:`packed_linear`, plus the bias. ``packed`` may be several weights stacked by rows (a
    fused q/k/v projection whose parts a GGUF file quantised differently); consecutive parts
    of one layout are joined into one at construction, so a product calls the kernel once per
    layout. Its ``weights_format`` is "q8" or "q4" (dikkat's own quantisation,
    :mod:`dikkat.weights.block_quantize`) or "gguf" (as a GGUF file held it)."""

    weights_format = "gguf"

    def __init__(
        self,
        packed: PackedWeight | Sequence[PackedWeight],
        bias: nn.Parameter | None,
        batched: bool,
    ) -> None:
        parts = _joined([packed] if isinstance(packed, PackedWeight) else list(packed))
        if {p.shape[1] for p in parts} != {parts[0].shape[1]}:
            raise ValueError(f"packed parts must share K, got {[p.shape for p in parts]}")
        where = {str(p.device) for p in parts}
        if where != {"cpu"}:
            raise ValueError(f"packed weights run on the CPU only, got them on {where}")
        N = sum(p.shape[0] for p in parts)
        super().__init__(torch.empty(N, parts[0].shape[1], device="meta"), bias, batched)
        self._device = torch.device("cpu")
        self.parts = tuple(p.in_groups() for p in parts)  # as the kernel reads them
        ends = torch.tensor([p.shape[0] for p in parts]).cumsum(0).tolist()
        self._spans = list(zip([0, *ends[:-1]], ends, strict=True))

    @property
    def weight(self) -> HeldWeight:
        shape = torch.Size((self.out_features, self.in_features))
        return HeldWeight(self.weights_format, shape, torch.float32, self._device)  # type: ignore[arg-type]

    @property
    def nbytes(self) -> int:
        b = self.bias
        held = sum(p.nbytes for p in self.parts)
        return held + (0 if b is None else b.numel() * b.element_size())

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        outs = []
        for (a, b), p in zip(self._spans, self.parts, strict=True):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                outs.append(packed_linear(x, p if (lo, hi) == (a, b) else p.rows(lo - a, hi - a)))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        bias = self._bias(start, stop)
        return y if bias is None else y + bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kinds={[p.kind for p in self.parts]}"


def _joined(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Consecutive parts of one layout (bits, block, zero point or offsets, the scales' dtype)
    stacked into one. Parts in groups of 16 rows stay so where every part but the last fills
    its groups (the stacked groups are then the groups of the stacked rows: no copy is made
    in rows and regrouped); otherwise they are stacked row by row."""
    if not parts:
        raise ValueError("a packed layer needs at least one packed weight")
    in_groups = all(p.grouped for p in parts) and all(p.shape[0] % ROWS == 0 for p in parts[:-1])
    if len(parts) > 1 and not in_groups:
        parts = [p.in_rows() for p in parts]
    out = [parts[0]]
    for p in parts[1:]:
        q = out[-1]
        if _layout(p) != _layout(q):
            out.append(p)
            continue

        def cat(a: Tensor | None, b: Tensor | None) -> Tensor | None:
            return None if a is None or b is None else torch.cat([a, b])

        kind = q.kind if q.kind == p.kind else f"{q.kind}+{p.kind}"
        out[-1] = PackedWeight(
            torch.cat([q.values, p.values]), torch.cat([q.scale, p.scale]), cat(q.offset, p.offset),
            q.zero, q.bits, q.block, kind, q.grouped, cat(q.super_scale, p.super_scale),
            cat(q.super_offset, p.super_offset),
        )  # fmt: skip
    return out


def _layout(p: PackedWeight) -> tuple:
    """What two weights stacked into one must share."""
    return p.bits, p.block, p.zero, p.offset is None, p.scale.dtype


class PackedEmbedding(nn.Module):
    """A token embedding (V, C) held as a :class:`PackedWeight`: the rows of the ids looked up
    are dequantised, in fp32. Its ``weight`` shows the shape, dtype and device (for the model's
    input checks and cache layout); the table itself is ``packed``, which a tied output layer
    (:class:`PackedLinear`) shares."""

    def __init__(self, packed: PackedWeight) -> None:
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.shape

    @property
    def weight(self) -> HeldWeight:
        return HeldWeight("gguf", torch.Size(self.packed.shape), torch.float32, self.packed.device)

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.packed.take(ids.reshape(-1))
        return dequantize(rows).view(*ids.shape, self.embedding_dim)

    def _apply(self, fn: Any, recurse: bool = True) -> PackedEmbedding:
        raise TypeError("a packed embedding cannot be moved or converted: load the model again")

    def extra_repr(self) -> str:
        p = self.packed
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={p.kind!r}"
