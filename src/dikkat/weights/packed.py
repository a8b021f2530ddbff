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
byte, 6-bit q (which holds 5-bit formats too) four in three bytes
(:mod:`dikkat.weights.bits`). Scales and offsets are fp16 where the file holds them so
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: kept as they are), fp32 for dikkat's own formats, and in two
levels as the K-quants hold them: an int8 a block (``scale``, ``offset``) times an fp16 a
super-block of 256 values (``super_scale``, ``super_offset``), their product exact in fp32 —
every GGUF format repacks exactly, and a Q6_K block of 16 values carries one byte of scale
where an fp32 one would take four. A weight is held row by row, or (``grouped``)
in the kernel's groups of 16 rows (:mod:`dikkat.weights.groups`): byte pair j of the
group's row r at pair 16 j + r, its scales and offsets 16 a block, so that one vector of the
kernel holds the same two values of 16 rows.
:mod:`dikkat.weights.gguf_blocks` repacks the file's blocks;
:mod:`dikkat.weights.block_quantize` packs any weight as Q8_0 and Q4_0 do.

The product ``x @ Wᵀ`` rounds each row of x to int16 per block of 32 (a = round(x / d),
d = max |x| / 32767), sums qⱼ · aⱼ in integers, and scales:

    y = Σ_b d · scale_b · Σⱼ (qⱼ − zero) aⱼ,   or   Σ_b d · (scale_b · Σⱼ qⱼ aⱼ + offset_b · Σⱼ aⱼ)

which is exactly the dequantised weight times the rounded activations, summed in fp32.
llama.cpp rounds activations to 8 bits (its Q8_0/Q8_1 blocks); on SmolLM2 that moved the logits
of a chat prompt by up to 0.5 from the dequantised model's and changed its first answer token,
where 16 bits keep them within 0.01 (tests/pretrained/test_real_models.py checks the losses).
:func:`packed_linear` runs it in dikkat's native kernel (:mod:`dikkat.kernels`) for any number
of rows (a prompt's prefill included: the kernel reads the packed blocks once for eight rows at a
time, which beats dequantising the weight for oneDNN's fp32 product, BENCHMARKS.md), so a row's
result never depends on the others in its batch. Where the kernel cannot be built, PyTorch
operations compute the same product, and from :data:`DENSE_ROWS` rows on multiply x itself by
the dequantised weight in fp32 instead (exact, and much faster there than integer sums
emulated in PyTorch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dikkat.kernels import qmm_ids_op, qmm_op
from dikkat.weights.bits import BITS, unpack_values
from dikkat.weights.groups import ROWS, gather_rows, to_groups, to_rows

__all__ = [
    "PackedWeight",
    "dequantize",
    "packed_linear",
    "packed_linear_ids",
    "round_activations",
]

GROUP = 32  # values an activation block (and most weight blocks) holds
SUPER = 256  # values a super-block of two-level scales (ggml's QK_K)
_LEVELS = 32767  # activations' integers: int16
# without the native kernel, from this many rows on (a prompt's prefill, not a decode step of a
# batch of up to DENSE_ROWS - 1 sequences) x is multiplied by the dequantised weight instead:
# oneDNN's fp32 product is far faster than the integer one emulated in PyTorch operations
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
    super_scale: Tensor | None = None
    super_offset: Tensor | None = None

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
        if self.scale.dtype not in (torch.float32, torch.float16, torch.int8):
            raise ValueError(
                f"scale must be fp32, fp16 or int8 (two levels), got {self.scale.dtype}"
            )
        if self.offset is not None and (
            self.offset.shape != self.scale.shape or self.offset.dtype != self.scale.dtype
        ):
            raise ValueError(
                f"offset must be shaped and typed as scale {tuple(self.scale.shape)} "
                f"{self.scale.dtype}, got {tuple(self.offset.shape)} {self.offset.dtype}"
            )
        self._check_units()

    def _check_units(self) -> None:
        """An int8 scale (and offset) comes with its fp16 super-block values, (N, K / 256)."""
        two_level = self.scale.dtype == torch.int8
        if two_level != (self.super_scale is not None) or (
            two_level and self.offset is not None
        ) != (self.super_offset is not None):
            raise ValueError(
                "an int8 scale (and offset) needs super_scale (and super_offset), and only it does"
            )
        N, K = self.shape
        for t in (self.super_scale, self.super_offset):
            if t is not None and (
                K % SUPER or t.shape != (N, K // SUPER) or t.dtype != torch.float16
            ):
                raise ValueError(
                    f"super_scale and super_offset must be (N, K / {SUPER}) = {(N, K // SUPER)} "
                    f"fp16 with K a multiple of {SUPER}, got {tuple(t.shape)} {t.dtype}"
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
        tensors = (self.values, self.scale, self.offset, self.super_scale, self.super_offset)
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

    def block_scales(self) -> tuple[Tensor, Tensor | None]:
        """The blocks' scales and offsets (N, K / block), row by row, in one level: as held, or
        for two levels in fp32, each the product of its int8 and its super-block's fp16."""
        p = self.in_rows()
        if p.super_scale is None:
            return p.scale, p.offset
        N, per = p.shape[0], SUPER // p.block

        def expand(t: Tensor, unit: Tensor) -> Tensor:
            return (t.float().view(N, -1, per) * unit.float()[..., None]).view(N, -1)

        offset = (
            None if p.offset is None or p.super_offset is None else expand(p.offset, p.super_offset)
        )
        return expand(p.scale, p.super_scale), offset

    def tensors(self) -> list[Tensor]:
        """The tensors it holds: values, scales and whichever of the offsets and super-block
        scales it has, in that order."""
        held = (self.values, self.scale, self.offset, self.super_scale, self.super_offset)
        return [t for t in held if t is not None]

    def _grouped_parts(self, fn: Callable[[Tensor, int], Tensor], grouped: bool) -> PackedWeight:
        """fn applied to the values (two bytes a unit) and the scales and offsets (one)."""
        return self._with(lambda t: fn(t, 2 if t is self.values else 1), grouped)

    def _with(self, fn: Callable[[Tensor], Tensor], grouped: bool) -> PackedWeight:
        def apply(t: Tensor | None) -> Tensor | None:
            return None if t is None else fn(t)

        return PackedWeight(
            fn(self.values), fn(self.scale), apply(self.offset), self.zero, self.bits, self.block,
            self.kind, grouped, apply(self.super_scale), apply(self.super_offset),
        )  # fmt: skip


def stacked(parts: Iterable[PackedWeight], rows: int) -> PackedWeight:
    """``rows`` rows given as parts of one layout, in order, each in groups of 16 rows and all
    but the last whole groups, as one weight in groups: filled in place part by part, so that
    an iterable that makes each part as it is asked for holds one part at a time beside the
    result (a large tensor repacked in slices)."""
    out: PackedWeight | None = None
    at = 0
    for p in parts:
        if not p.grouped or (at + p.shape[0] < rows and p.shape[0] % ROWS):
            raise ValueError(f"parts must be in groups, whole groups but the last: {p.shape}")
        if at + p.shape[0] > rows:
            raise ValueError(f"the parts hold more than rows={rows} rows")
        if out is None:
            out = p._with(lambda t: t.new_empty((rows, *t.shape[1:])), True)
        layout = [(t.dtype, t.shape[1:]) for t in p.tensors()]
        if (p.bits, p.block, p.zero) != (out.bits, out.block, out.zero) or layout != [
            (t.dtype, t.shape[1:]) for t in out.tensors()
        ]:
            raise ValueError(f"parts must share one layout: {p.kind} beside {out.kind}")
        for held, part in zip(out.tensors(), p.tensors(), strict=True):
            held[at : at + p.shape[0]] = part
        at += p.shape[0]
    if out is None or at != rows:
        raise ValueError(f"the parts hold {at} rows, not {rows}")
    return out


def unpack(p: PackedWeight) -> Tensor:
    """The integers q (N, K) uint8, row by row."""
    return unpack_values(p.in_rows().values, p.bits)


def dequantize(p: PackedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight (N, K) that ``p`` stands for, computed in fp32 (exactly what the file's own
    dequantisation gives for a repacked GGUF tensor), in ``dtype``; in the native kernel where
    it is built, else with PyTorch operations (the same numbers)."""
    p = p.in_rows()
    scale, offset = p.block_scales()
    if _native() is not None and p.device.type == "cpu":
        w = torch.ops.dikkat_native.dequantize(p.values, scale, offset, p.bits, p.block, p.zero)
        return w.to(dtype)
    return _dequantize(p).to(dtype)


def _dequantize(p: PackedWeight) -> Tensor:
    N, K = p.shape
    q = unpack(p).view(N, K // p.block, p.block).float()
    scale, offset = (None if t is None else t[..., None].float() for t in p.block_scales())
    w = scale * (q - p.zero) if offset is None else scale * q + offset
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
    if op is not None:
        p = p.in_groups()  # (a PackedLinear holds them so already)
        out = op(rows, p.values, p.scale, p.offset, p.super_scale, p.super_offset, p.bits,
                 p.block, p.zero)  # fmt: skip
    elif rows.shape[0] >= DENSE_ROWS:
        out = _dense(rows, p)
    else:
        out = _product(rows, p)
    out = out.view(*x.shape[:-1], N)
    if bias is not None:
        out = out + bias
    return out if out.dtype == x.dtype else out.to(x.dtype)


def packed_linear_ids(x: Tensor, p: PackedWeight, ids: Tensor, rows: int) -> Tensor:
    """Row m of x (M, K) times its own block of ``rows`` rows of the weight, rows
    [ids[m] · rows, ids[m] · rows + rows) — each token times the expert it goes to, of experts
    stacked by rows — as :func:`packed_linear` multiplies them: (M, rows), fp32. ``rows`` is a
    multiple of 16 (each block whole groups of the kernel); rows of one id side by side (sorted)
    read their block once."""
    N, K = p.shape
    if x.dim() != 2 or x.shape[1] != K or ids.shape != (x.shape[0],):
        raise ValueError(
            f"x must be (M, {K}) and ids (M,), got {tuple(x.shape)} and {tuple(ids.shape)}"
        )
    if ids.dtype != torch.int64:
        raise TypeError(f"ids must be int64 expert indices, got {ids.dtype}")
    if rows % ROWS or N % rows:
        raise ValueError(f"rows={rows} must be a multiple of {ROWS} that divides N={N}")
    op = qmm_ids_op() if x.device.type == "cpu" else None
    if op is not None:
        p = p.in_groups()
        return op(x.float(), ids, p.values, p.scale, p.offset, p.super_scale, p.super_offset,
                  p.bits, p.block, p.zero, rows)  # fmt: skip
    out = x.new_empty(x.shape[0], rows, dtype=torch.float32)
    for m, e in enumerate(ids.tolist()):
        out[m] = packed_linear(x[m : m + 1].float(), p.rows(e * rows, (e + 1) * rows))[0]
    return out


_NATIVE: list[Callable[..., Tensor] | None] = []  # the kernel, once looked up


def _native() -> Callable[..., Tensor] | None:
    """:func:`dikkat.kernels.qmm_op`, kept in a list that torch.compile reads as a constant
    (it warns at every traced call of a functools.cache'd function)."""
    if not _NATIVE:
        _NATIVE.append(qmm_op())
    return _NATIVE[0]


def _dense(rows: Tensor, p: PackedWeight) -> Tensor:
    """Many rows (a prompt's prefill) without the native kernel: x times the dequantised weight,
    in fp32, a few thousand weight rows dequantised at a time."""
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
