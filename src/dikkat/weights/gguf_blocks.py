"""A GGUF file's quantised blocks read and repacked, without expanding them to fp32, into the one
layout of :class:`dikkat.weights.packed.PackedWeight`; which block kinds there are, and how each
is read, is :data:`dikkat.weights.formats.FORMATS`.

Each GGML block format is read into unsigned integers, one scale per block of 32 (16 for Q6_K)
and, for the formats with a minimum, one offset per block — in fp16 as the blocks of Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1 store them, and in two levels as the K-quants do (an int8 a block, the
file's 6- or 8-bit sub-scale or minimum, times an fp16 a super-block of 256: its d or −dmin) —
such that
``dequantize(packed)`` equals the ``gguf`` package's own ``dequantize`` of the same bytes, bit
for bit (tests/weights/test_gguf_blocks.py). The block layouts are those of ggml's
``ggml-common.h`` (https://github.com/ggml-org/ggml/blob/master/src/ggml-common.h):

=====  ======================================  =====================  ===================
type   block (bytes: fields)                   becomes                w = …
=====  ======================================  =====================  ===================
Q8_0   32 values, 34: d f16, q int8 ×32         8 bits, zero 128       d·(q − 128)
Q4_0   32 values, 18: d f16, nibbles ×16        4 bits, zero 8         d·(q − 8)
Q4_1   32 values, 20: d, m f16, nibbles ×16     4 bits, offset m       d·q + m
Q5_0   32 values, 22: d f16, high bits u32, …   6 bits, zero 16        d·(q − 16)
Q5_1   32 values, 24: d, m f16, high bits, …    6 bits, offset m       d·q + m
Q4_K   256 values, 144: d, dmin f16, 6-bit      4 bits, per 32:        d·sc·q − dmin·mn
       sub-scales and mins ×8 (12 bytes), …
Q5_K   256 values, 176: as Q4_K, high bits …    6 bits, per 32         d·sc·q − dmin·mn
Q6_K   256 values, 210: low 4 bits, high 2      6 bits, per 16,        d·sc·(q − 32)
       bits, int8 sub-scales ×16, d f16         zero 32
=====  ======================================  =====================  ===================

5-bit integers take 6 bits here (:mod:`dikkat.weights.bits`): the kernel reads 4, 6 or 8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dikkat.weights.bits import pack
from dikkat.weights.packed import PackedWeight

__all__ = [
    "QK_K",
    "GGUFBlocks",
    "read_q4_0",
    "read_q4_1",
    "read_q4_k",
    "read_q5_0",
    "read_q5_1",
    "read_q5_k",
    "read_q6_k",
    "read_q8_0",
]

QK_K = 256  # values a K-quant super-block


def _f16(column: np.ndarray) -> np.ndarray:
    """A (n, 2) uint8 column of fp16 → (n,) fp32."""
    return np.ascontiguousarray(column).view(np.float16)[:, 0].astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes of two nibbles → (n, 32): values 0-15 the low nibbles, 16-31 the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes: a little-endian bit j per value j → (n, 32) of 0/1."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit sub-scales and eight 6-bit mins → (n, 8), (n, 8).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise; bytes 8-11
    hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2
    bits are the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s, m, both = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([s & 0x3F, (both & 0x0F) | ((s >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 0x3F, (both >> 4) | ((m >> 6) << 4)], axis=1)
    return sc, mn


# a reader: a file's blocks (n, bytes a block) → (q, scale, offset or None, zero, units): units
# None, or for two levels the super-blocks' fp16 (d, −dmin or None) that scale and offset times


def read_q8_0(b: np.ndarray) -> tuple:
    return b[:, 2:] ^ 0x80, _f16(b[:, 0:2]), None, 128, None  # int8 → offset binary: x + 128


def read_q4_0(b: np.ndarray) -> tuple:
    return _low_high(b[:, 2:18]), _f16(b[:, 0:2]), None, 8, None


def read_q4_1(b: np.ndarray) -> tuple:
    return _low_high(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 0, None


def read_q5_0(b: np.ndarray) -> tuple:
    q = _low_high(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)
    return q, _f16(b[:, 0:2]), None, 16, None


def read_q5_1(b: np.ndarray) -> tuple:
    q = _low_high(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4)
    return q, _f16(b[:, 0:2]), _f16(b[:, 2:4]), 0, None


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes → (n, 8, 32) low 4 bits: 32 bytes per pair of sub-blocks, the
    low nibbles the first sub-block, the high nibbles the second."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)


def read_q4_k(b: np.ndarray) -> tuple:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return _k_low(b[:, 16:144]), sc, mn, 0, (d, -dmin)


def read_q5_k(b: np.ndarray) -> tuple:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    # bit i of high byte j: the fifth bit of value j of sub-block i
    high = (b[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # (n, 32, 8)
    q = _k_low(b[:, 48:176]) | (high.transpose(0, 2, 1) << 4)
    return q, sc, mn, 0, (d, -dmin)


def read_q6_k(b: np.ndarray) -> tuple:
    ql, qh = b[:, 0:128], b[:, 128:192]
    d = _f16(b[:, 208:210])
    # 64 bytes of low 4 bits per half (128 values): low nibbles values 0-63, high 64-127;
    # 32 bytes of high 2 bits per half: bits 0-1, 2-3, 4-5, 6-7 for values 0-31, 32-63, …
    halves = ql.reshape(-1, 2, 1, 64)
    low = np.concatenate([halves & 0x0F, halves >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = low | (high.reshape(-1, 8, 32) << 4)
    return q, b[:, 192:208].view(np.int8), None, 32, (d, None)


@dataclass(frozen=True)
class GGUFBlocks:
    """A GGML block kind: ``values`` a block in ``nbytes`` bytes, read by ``read`` into integers
    of ``bits`` bits (4, 6 or 8: what the kernel reads) with a scale per ``scale_block`` values."""

    kind: str  # the GGML type's name: "Q4_K"
    values: int
    nbytes: int
    read: Callable[[np.ndarray], tuple]  # a reader above
    bits: int
    scale_block: int

    def repack(
        self, raw: np.ndarray, shape: tuple[int, int], *, name: str = "the tensor"
    ) -> PackedWeight:
        """The bytes ``raw`` (rows, bytes a row) of a GGUF tensor of this kind and torch shape
        ``shape`` (N, K) as a :class:`PackedWeight`. A block whose fp16 scale or minimum (a
        K-quant's super-block d or dmin) is NaN or ±Inf is refused (``ValueError`` naming
        ``name``, the row and the block): checking those fields is checking every weight, since
        the integers times finite fp16 values stay finite in fp32."""
        kind, per_block, nbytes, bits = self.kind, self.values, self.nbytes, self.bits
        N, K = shape
        if K % per_block or raw.shape != (N, K // per_block * nbytes):
            raise ValueError(
                f"a {kind} tensor of shape {shape} must be ({N}, {K // per_block * nbytes}) "
                f"bytes of {per_block}-value blocks, got {raw.shape}"
            )
        q, scale, offset, zero, units = self.read(np.ascontiguousarray(raw).reshape(-1, nbytes))
        floats = [scale, offset] if units is None else list(units)  # the fp16 fields, as fp32
        _check_finite(floats, N, "block" if units is None else "super-block", name)
        q = torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(N, K))
        dtype = np.float16 if units is None else np.int8  # (a K-quant's 6-bit sub-scales fit int8)
        scale_t, offset_t = (_rows(a, dtype, N) for a in (scale, offset))
        supers = (None, None) if units is None else (_rows(a, np.float16, N) for a in units)
        # in the kernel's groups already, so that a table and its tied output share one copy
        return PackedWeight(
            pack(q, bits), scale_t, offset_t, zero, bits, self.scale_block, kind, False, *supers
        ).in_groups()


def _rows(a: np.ndarray | None, dtype: type, N: int) -> torch.Tensor | None:
    """``a`` (any shape holding N rows) as an (N, ·) tensor of ``dtype``; the values fit it
    exactly (the file's own fp16 values, small integers)."""
    return (
        None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(N, -1))
    )


def _check_finite(fields: list[np.ndarray | None], N: int, unit: str, name: str) -> None:
    """Each array (one value a block, N rows' blocks in order) holds finite numbers only."""
    for a in fields:
        if a is None:
            continue
        finite = np.isfinite(a)
        if not finite.all():
            first = int(np.argmin(finite.reshape(-1)))
            per_row = a.size // N
            raise ValueError(
                f"{name}: {unit} {first % per_row} of row {first // per_row} has a non-finite "
                f"scale or minimum ({a.reshape(-1)[first]}): the file is damaged"
            )
