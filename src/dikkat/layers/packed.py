"""Weights packed in blocks of 4-, 6- or 8-bit integers, as GGUF files hold them, and their
product.

Notation: ``N`` output features (rows of the weight), ``K`` input features, ``B`` values a block.

A row of K values is cut into blocks of B = 32 (16 for Q6_K) consecutive values; block b keeps
unsigned integers q and one ``scale`` (and, in formats with a per-block minimum, one
``offset``), and stands for

    wⱼ = scale_b · (qⱼ − zero)          (symmetric: Q8_0, Q4_0, Q5_0, Q6_K; dikkat's q8, q4)
    wⱼ = scale_b · qⱼ + offset_b        (with a minimum: Q4_1, Q4_K, Q5_K)

This is llama.cpp's family of block formats (https://github.com/ggml-org/ggml/blob/master/
docs/gguf.md) in one layout that one kernel reads: 8-bit q one byte a value, 4-bit q two a
byte, 6-bit q (which holds 5-bit formats too) three values in four bytes
(:mod:`dikkat.layers.packed_bits`). Scales and offsets are fp16 where the file holds them so (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1:
kept as they are, a sixth fewer bytes to read than fp32 would take) and fp32 otherwise, so that
every GGUF format repacks exactly (a K-quant's scale is its super-block's fp16 scale times a
6-bit sub-scale, which fp16 cannot always hold). A weight is held row by row, or (``grouped``)
in the kernel's groups of 16 rows (:mod:`dikkat.layers.packed_groups`): byte pair j of the
group's row r at pair 16 j + r, its scales and offsets 16 a block, so that one vector of the
kernel holds the same two values of 16 rows.
:mod:`dikkat.pretrained.gguf_packed` repacks the file's blocks;
:mod:`dikkat.layers.packed_quantize` packs any weight as Q8_0 and Q4_0 do.

The product ``x @ Wᵀ`` rounds each row of x to int16 per block of 32 (a = round(x / d),
d = max |x| / 32767), sums qⱼ · aⱼ in integers, and scales:

    y = Σ_b d · scale_b · Σⱼ (qⱼ − zero) aⱼ,   or   Σ_b d · (scale_b · Σⱼ qⱼ aⱼ + offset_b · Σⱼ aⱼ)

which is exactly the dequantised weight times the rounded activations, summed in fp32.
llama.cpp rounds activations to 8 bits (its Q8_0/Q8_1 blocks); on SmolLM2 that moved the logits
of a chat prompt by up to 0.5 from the dequantised model's and changed its first answer token,
where 16 bits keep them within 0.01 (tests/pretrained/test_real_models.py checks the losses).
:func:`packed_linear` runs it in dikkat's native kernel (:mod:`dikkat.core.native`), or, where
that cannot be built, with PyTorch operations that compute the same product. From
:data:`DENSE_ROWS` rows on (a prompt's prefill) it multiplies x itself by the dequantised weight
in fp32 instead — exact, and faster there; a decode step of fewer sequences never does, so a
row's result does not depend on the others in its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.core.native import qmm_op
from dikkat.layers.held import HeldWeight, InferenceLinear
from dikkat.layers.packed_bits import BITS, unpack_values
from dikkat.layers.packed_groups import ROWS, gather_rows, to_groups, to_rows

__all__ = [
    "PackedEmbedding",
    "PackedLinear",
    "PackedWeight",
    "dequantize",
    "packed_linear",
    "round_activations",
]

GROUP = 32  # values an activation block (and most weight blocks) holds
_LEVELS = 32767  # activations' integers: int16
# from this many rows on (a prompt's prefill, not a decode step of a batch of up to DENSE_ROWS - 1
# sequences), x is multiplied by the dequantised weight instead: at such sizes the product is
# bound by arithmetic, which oneDNN's fp32 kernels do faster than the integer one, and the
# dequantising is paid once for all rows
DENSE_ROWS = 32
_FALLBACK_ROWS = 4096  # weight rows dequantised at a time by the PyTorch product


@dataclass(frozen=True)
class PackedWeight:
    """A weight (N, K) as blocks of unsigned integers (see the module's notes).

    ``values``: (N, K) uint8 for 8 bits, (N, K / 2) for 4 bits; ``scale`` (N, K / block) fp32
    or fp16; ``offset`` the same shape and dtype, or None for symmetric formats, whose integers
    are centred on ``zero``. ``kind`` names where it came from ("Q4_1", "Q6_K", "q8", …).
    ``grouped``: whether the three are in the kernel's groups of 16 rows (:meth:`in_groups`)
    rather than row by row (:meth:`in_rows`).
    """

    values: Tensor
    scale: Tensor
    offset: Tensor | None
    zero: int
    bits: int
    block: int
    kind: str
    grouped: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS or self.block not in (16, GROUP):
            raise ValueError(
                f"bits must be one of {BITS} and block 16 or 32, got {self.bits}, {self.block}"
            )
        N, K = self.shape
        if self.values.dtype != torch.uint8 or self.values.shape[1] * 8 != K * self.bits:
            raise ValueError(f"values must be (N, K·bits/8) uint8, got {tuple(self.values.shape)}")
        if K % GROUP or self.scale.shape != (N, K // self.block):
            raise ValueError(
                f"scale must be (N, K / {self.block}) = {(N, K // self.block)} with K a multiple "
                f"of {GROUP}, got {tuple(self.scale.shape)}"
            )
        if self.scale.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"scale must be fp32 or fp16, got {self.scale.dtype}")
        if self.offset is not None and (
            self.offset.shape != self.scale.shape or self.offset.dtype != self.scale.dtype
        ):
            raise ValueError(
                f"offset must be shaped and typed as scale {tuple(self.scale.shape)} "
                f"{self.scale.dtype}, got {tuple(self.offset.shape)} {self.offset.dtype}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): the weight's shape."""
        N, nbytes = self.values.shape
        return N, nbytes * 8 // self.bits

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the inputs it multiplies and the outputs it gives: fp32."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        """Bytes of the integers, scales and offsets: what one product reads."""
        tensors = (self.values, self.scale, self.offset)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Output features [start, stop): views where they are whole groups of 16 rows (or row
        by row), else a copy."""
        N = self.shape[0]
        if self.grouped and (start % ROWS or (stop % ROWS and stop != N)):
            a, b = start // ROWS * ROWS, min(N, -(-stop // ROWS) * ROWS)  # the groups around
            return self.rows(a, b).in_rows().rows(start - a, stop - a).in_groups()
        return self._with(lambda t: t[start:stop], self.grouped)

    def take(self, index: Tensor) -> PackedWeight:
        """The rows ``index`` (a gather: an embedding lookup), row by row."""
        if not self.grouped:
            return self._with(lambda t: t[index], False)
        N = self.shape[0]  # (the gather below clamps: an index out of range would pass silently)
        if (
            not torch.compiler.is_compiling()
            and index.numel()
            and not (int(index.min()) >= 0 and int(index.max()) < N)
        ):
            raise ValueError(f"index must lie in [0, {N}), got {index.min()}..{index.max()}")
        return self._grouped_parts(lambda t, unit: gather_rows(t, unit, index), False)

    def in_groups(self) -> PackedWeight:
        """The same weight in the kernel's groups of 16 rows (itself if it is)."""
        return self if self.grouped else self._grouped_parts(to_groups, True)

    def in_rows(self) -> PackedWeight:
        """The same weight row by row (itself if it is)."""
        return self._grouped_parts(to_rows, False) if self.grouped else self

    def _grouped_parts(self, fn: Callable[[Tensor, int], Tensor], grouped: bool) -> PackedWeight:
        """fn applied to the values (two bytes a unit) and the scales and offsets (one)."""
        offset = None if self.offset is None else fn(self.offset, 1)
        return PackedWeight(
            fn(self.values, 2), fn(self.scale, 1), offset, self.zero, self.bits, self.block,
            self.kind, grouped,
        )  # fmt: skip

    def _with(self, fn: Callable[[Tensor], Tensor], grouped: bool) -> PackedWeight:
        offset = None if self.offset is None else fn(self.offset)
        return PackedWeight(
            fn(self.values), fn(self.scale), offset, self.zero, self.bits, self.block,
            self.kind, grouped,
        )  # fmt: skip


def unpack(p: PackedWeight) -> Tensor:
    """The integers q (N, K) uint8, row by row."""
    return unpack_values(p.in_rows().values, p.bits)


def dequantize(p: PackedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight (N, K) that ``p`` stands for, computed in fp32 (exactly what the file's own
    dequantisation gives for a repacked GGUF tensor), in ``dtype``; in the native kernel where
    it is built, else with PyTorch operations (the same numbers)."""
    p = p.in_rows()
    if _native() is not None and p.device.type == "cpu":
        w = torch.ops.dikkat_native.dequantize(p.values, p.scale, p.offset, p.bits, p.block, p.zero)
        return w.to(dtype)
    return _dequantize(p).to(dtype)


def _dequantize(p: PackedWeight) -> Tensor:
    N, K = p.shape
    q = unpack(p).view(N, K // p.block, p.block).float()
    scale = p.scale[..., None].float()
    w = scale * (q - p.zero) if p.offset is None else scale * q + p.offset[..., None].float()
    return w.view(N, K)


def round_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows x (M, K) rounded to int16 per block of 32: integers a (M, K) (as fp32) and scales d
    (M, K / 32), a = round(x / d), d = max |x| / 32767 (0 for a block of zeros)."""
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point() or x.shape[1] % GROUP:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"x must be floating-point rows (M, K) with K a multiple of {GROUP}, got {shape}"
        )
    M, K = x.shape
    blocks = x.float().reshape(M, K // GROUP, GROUP)
    d = blocks.abs().amax(dim=-1) / _LEVELS  # (M, K/32)
    a = torch.where(d[..., None] > 0, torch.round(blocks / d[..., None]), 0.0)
    return a.view(M, K), d


def packed_linear(x: Tensor, p: PackedWeight, bias: Tensor | None = None) -> Tensor:
    """``x @ Wᵀ + bias`` for x (..., K), W held as ``p``: the dequantised weight times x rounded
    to int16 per block of 32 (see the module's notes); the result in x's dtype."""
    N, K = p.shape
    if x.shape[-1] != K:
        raise ValueError(f"x must end in the weight's {K} input features, got {tuple(x.shape)}")
    rows = x.reshape(-1, K).float()
    op = _native() if x.device.type == "cpu" else None
    if rows.shape[0] >= DENSE_ROWS:
        out = _dense(rows, p)
    elif op is not None:
        p = p.in_groups()  # (a PackedLinear holds them so already)
        out = op(rows, p.values, p.scale, p.offset, p.bits, p.block, p.zero)
    else:
        out = _product(rows, p)
    out = out.view(*x.shape[:-1], N)
    if bias is not None:
        out = out + bias
    return out if out.dtype == x.dtype else out.to(x.dtype)


_NATIVE: list[Callable[..., Tensor] | None] = []  # the kernel, once looked up


def _native() -> Callable[..., Tensor] | None:
    """:func:`dikkat.core.native.qmm_op`, kept in a list that torch.compile reads as a constant
    (it warns at every traced call of a functools.cache'd function)."""
    if not _NATIVE:
        _NATIVE.append(qmm_op())
    return _NATIVE[0]


def _dense(rows: Tensor, p: PackedWeight) -> Tensor:
    """Many rows (a prompt's prefill): x times the dequantised weight, in fp32, a few thousand
    weight rows dequantised at a time."""
    N = p.shape[0]
    parts = [F.linear(rows, dequantize(p.rows(n, min(n + _FALLBACK_ROWS, N)))) for n in
             range(0, N, _FALLBACK_ROWS)]  # fmt: skip
    return torch.cat(parts, dim=1) if len(parts) != 1 else parts[0]


def _product(rows: Tensor, p: PackedWeight) -> Tensor:
    """The product of :func:`packed_linear` with PyTorch operations: the rounded activations
    times the dequantised weight, a few thousand weight rows at a time."""
    a, d = round_activations(rows)
    M, K = rows.shape
    x = (a.view(M, K // GROUP, GROUP) * d[..., None]).view(M, K)
    N = p.shape[0]
    parts = [F.linear(x, dequantize(p.rows(n, min(n + _FALLBACK_ROWS, N)))) for n in
             range(0, N, _FALLBACK_ROWS)]  # fmt: skip
    return torch.cat(parts, dim=1) if len(parts) != 1 else parts[0]


class PackedLinear(InferenceLinear):
    """A linear layer holding its weight as :class:`PackedWeight` row blocks: the product of
    :func:`packed_linear`, plus the bias. ``packed`` may be several weights stacked by rows (a
    fused q/k/v projection whose parts a GGUF file quantised differently); consecutive parts
    of one layout are joined into one at construction, so a product calls the kernel once per
    layout. Its ``weights_format`` is "q8" or "q4" (dikkat's own quantisation,
    :mod:`dikkat.layers.packed_quantize`) or "gguf" (as a GGUF file held it)."""

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
    stacked into one."""
    if not parts:
        raise ValueError("a packed layer needs at least one packed weight")
    if len(parts) > 1:
        parts = [p.in_rows() for p in parts]
    out = [parts[0]]
    for p in parts[1:]:
        q = out[-1]
        if (p.bits, p.block, p.zero, p.offset is None, p.scale.dtype) != (
            q.bits,
            q.block,
            q.zero,
            q.offset is None,
            q.scale.dtype,
        ):
            out.append(p)
            continue
        offset = None if p.offset is None or q.offset is None else torch.cat([q.offset, p.offset])
        kind = q.kind if q.kind == p.kind else f"{q.kind}+{p.kind}"
        out[-1] = PackedWeight(
            torch.cat([q.values, p.values]), torch.cat([q.scale, p.scale]), offset, q.zero,
            q.bits, q.block, kind,
        )  # fmt: skip
    return out


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
