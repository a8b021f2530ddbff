"""Layers holding :class:`~dikkat.weights.packed.PackedWeight`: a linear layer (its parts stacked
by rows, as a GGUF file may quantise a fused projection's parts differently), a token
embedding, which a tied output layer shares, and a mixture's experts as a file stacks them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.kernels import qmm_experts_op
from dikkat.weights.groups import ROWS
from dikkat.weights.held import HeldWeight, InferenceLinear
from dikkat.weights.packed import PackedWeight, dequantize, packed_linear, packed_linear_ids

__all__ = ["PackedEmbedding", "PackedExperts", "PackedLinear"]


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


class PackedExperts(nn.Module):
    """A mixture's E gated-MLP experts (:class:`~dikkat.layers.SparseMoE`) held as a GGUF file
    stacks them, packed blocks: ``gate`` and ``up`` (E·H, C), ``down`` (E·C, H). ``forward(x,
    ids)`` gives row m of x (M, C) through expert ``ids[m]``, ``down(act(gate x) ∘ up x)``, as
    each expert alone gives it, in one product per stack for all rows
    (:func:`~dikkat.weights.packed.packed_linear_ids`): rows of one expert side by side read its
    weights once. Gate and up of one layout are joined at construction into ``gate_up`` (E·2H,
    C), each expert's gate rows then its up rows, multiplied at once. H and C are multiples of
    16; :meth:`expert` gives expert e's three weights, views of the stacks."""

    def __init__(self, gate: PackedWeight, up: PackedWeight, down: PackedWeight, n_experts: int,
                 act: nn.Module) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(act, nn.SiLU | nn.GELU) or getattr(act, "approximate", "tanh") != "tanh":
            raise ValueError(f"act must be SiLU or the tanh GELU, got {act}")
        self.n_experts, self.act = n_experts, act
        self.hidden, self.d_model = gate.shape[0] // n_experts, gate.shape[1]
        if (
            gate.shape != up.shape
            or gate.shape[0] != n_experts * self.hidden
            or down.shape != (n_experts * self.d_model, self.hidden)
            or self.hidden % ROWS
            or self.d_model % ROWS
        ):
            raise ValueError(
                f"experts must stack as gate, up (E·H, C) and down (E·C, H) with H and C "
                f"multiples of {ROWS}, got {gate.shape}, {up.shape}, {down.shape} for E={n_experts}"
            )
        gate, up, self.down = gate.in_groups(), up.in_groups(), down.in_groups()
        joined = _layout(gate) == _layout(up) and gate.kind == up.kind
        self.gate_up = _by_expert(gate, up, n_experts) if joined else None
        self.gate, self.up = (None, None) if joined else (gate, up)

    @property
    def nbytes(self) -> int:
        held = [self.gate_up, self.gate, self.up, self.down]
        return sum(p.nbytes for p in held if p is not None)

    def expert(self, e: int) -> tuple[PackedWeight, ...]:
        """Expert e's weights, views of the stacks: (gate_up, down), or (gate, up, down)."""
        held = [p for p in (self.gate_up, self.gate, self.up, self.down) if p is not None]
        return tuple(p.rows(e * (n := p.shape[0] // self.n_experts), (e + 1) * n) for p in held)

    def mix(self, flat: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Tokens (M, C) through their k picks ``experts`` (M, k), weighted by ``weights``
        (M, k) and summed: the (token, pick) pairs sorted by expert, so that an expert's rows
        read its weights once, and each token's picks summed in the order of their experts. In
        one native call (``qmm_experts``) where gate and up are joined, else here."""
        op = qmm_experts_op()
        if op is not None and self.gate_up is not None:
            g, d = self.gate_up, self.down
            return op(flat, weights, experts, g.values, g.scale, g.offset, g.super_scale,
                      g.super_offset, g.bits, g.block, g.zero, d.values, d.scale, d.offset,
                      d.super_scale, d.super_offset, d.bits, d.block, d.zero, self.hidden,
                      isinstance(self.act, nn.GELU))  # fmt: skip
        ids, order = torch.sort(experts.reshape(-1))
        token = order.div(experts.shape[1], rounding_mode="floor")
        y = self(flat.index_select(0, token), ids)
        y.mul_(weights.reshape(-1).index_select(0, order)[:, None])
        return torch.zeros_like(flat).index_add_(0, token, y)

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        H = self.hidden
        if self.gate_up is not None:
            g, u = packed_linear_ids(x, self.gate_up, ids, 2 * H).chunk(2, dim=-1)
        else:
            assert self.gate is not None and self.up is not None
            g, u = (packed_linear_ids(x, p, ids, H) for p in (self.gate, self.up))
        return packed_linear_ids(self.act(g).mul_(u), self.down, ids, self.d_model)

    def _apply(self, fn: Any, recurse: bool = True) -> PackedExperts:
        raise TypeError("packed experts cannot be moved or converted: load the model again")

    def extra_repr(self) -> str:
        held = [p for p in (self.gate_up, self.gate, self.up, self.down) if p is not None]
        return f"{self.n_experts} experts of {self.d_model} → {self.hidden}, " + (
            f"kinds={[p.kind for p in held]}"
        )


def _by_expert(a: PackedWeight, b: PackedWeight, n: int) -> PackedWeight:
    """Two stacks of n experts' rows (in whole groups of 16) as one: expert e's rows of ``a``,
    then its rows of ``b``, for e = 0 … n − 1."""

    def cat(x: Tensor | None, y: Tensor | None) -> Tensor | None:
        if x is None or y is None:
            return None
        return torch.cat([x.view(n, -1, *x.shape[1:]), y.view(n, -1, *y.shape[1:])], 1).flatten(
            0, 1
        )

    return PackedWeight(
        cat(a.values, b.values), cat(a.scale, b.scale), cat(a.offset, b.offset), a.zero,  # type: ignore[arg-type]
        a.bits, a.block, a.kind, True, cat(a.super_scale, b.super_scale),
        cat(a.super_offset, b.super_offset),
    )  # fmt: skip
