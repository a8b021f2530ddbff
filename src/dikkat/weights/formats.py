"""The one registry of weight formats: a format's name → everything about it.

Two kinds of names share it. The inference formats ("fp32", "bf16", "int8", "w8a8", "q8", "q4":
:data:`WeightFormat`) are what :func:`dikkat.weights.inference_model` converts a model's weights
to; each names the layer that holds and multiplies them. The GGUF block kinds ("Q8_0", …,
"Q6_K": :data:`PACKED_KINDS`) are what a GGUF file holds and dikkat keeps packed; each adds how a
file's blocks are read and repacked (:mod:`dikkat.weights.gguf_blocks`). The GGUF 16-bit kinds
("F16", "BF16": :data:`HALF_KINDS`) are kept as the file holds them, as a torch dtype
(:mod:`dikkat.weights.half`). Every entry names the
native kernel its product calls (:mod:`dikkat.kernels`), or None where the product is PyTorch's
own (oneDNN, FBGEMM), and every product falls back to PyTorch operations where the kernels are
not built.

Adding a format is one entry here: its layer (a subclass of
:class:`~dikkat.weights.held.InferenceLinear`) and, for a GGUF kind, its reader; add its name
to :data:`WeightFormat` too where ``inference_model`` should make it
(``tests/weights/test_formats.py`` holds the two to each other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
import torch

from dikkat.kernels import linear_rows_op, qmm_op
from dikkat.weights.block_quantize import Q4Linear, Q8Linear
from dikkat.weights.dense import Bf16Linear, Fp32Linear, Int8Linear, W8A8Linear
from dikkat.weights.gguf_blocks import (
    QK_K,
    GGUFBlocks,
    read_q4_0,
    read_q4_1,
    read_q4_k,
    read_q5_0,
    read_q5_1,
    read_q5_k,
    read_q6_k,
    read_q8_0,
)
from dikkat.weights.half import HalfLinear
from dikkat.weights.held import InferenceLinear
from dikkat.weights.packed import PackedWeight
from dikkat.weights.packed_layers import PackedLinear

__all__ = [
    "FORMATS",
    "HALF_KINDS",
    "PACKED_KINDS",
    "WEIGHT_FORMATS",
    "Format",
    "WeightFormat",
    "check_weights",
    "repack",
]

# the inference formats, for type checkers: the names of FORMATS without GGUF blocks
WeightFormat = Literal["fp32", "bf16", "int8", "w8a8", "q8", "q4"]


@dataclass(frozen=True)
class Format:
    """One weight format: the layer that holds and multiplies it, the :mod:`dikkat.kernels` op
    its product calls (None: PyTorch's own), and for a GGUF block kind how a file's blocks are
    read and repacked, or for a 16-bit kind the dtype it is held in."""

    name: str
    layer: type[InferenceLinear]
    kernel: Callable[[], Callable[..., object] | None] | None
    blocks: GGUFBlocks | None = None
    dtype: torch.dtype | None = None  # a GGUF kind held as it is, as this torch dtype


def _gguf(
    kind: str,
    values: int,
    nbytes: int,
    read: Callable[[np.ndarray], tuple],
    bits: int,
    scale_block: int,
) -> Format:
    """A GGUF block kind, kept packed and multiplied by :class:`PackedLinear` (``qmm``)."""
    blocks = GGUFBlocks(kind, values, nbytes, read, bits, scale_block)
    return Format(kind, PackedLinear, qmm_op, blocks)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp32", Fp32Linear, linear_rows_op),  # and oneDNN's packed copies
        Format("bf16", Bf16Linear, None),  # oneDNN
        Format("int8", Int8Linear, None),  # aten._weight_int8pack_mm
        Format("w8a8", W8A8Linear, None),  # FBGEMM
        Format("q8", Q8Linear, qmm_op),  # dikkat's own Q8_0
        Format("q4", Q4Linear, qmm_op),  # dikkat's own Q4_0
        # GGUF kinds: values and bytes a block, reader, bits, values a scale
        _gguf("Q8_0", 32, 34, read_q8_0, 8, 32),
        _gguf("Q4_0", 32, 18, read_q4_0, 4, 32),
        _gguf("Q4_1", 32, 20, read_q4_1, 4, 32),
        _gguf("Q5_0", 32, 22, read_q5_0, 6, 32),
        _gguf("Q5_1", 32, 24, read_q5_1, 6, 32),
        _gguf("Q4_K", QK_K, 144, read_q4_k, 4, 32),
        _gguf("Q5_K", QK_K, 176, read_q5_k, 6, 32),
        _gguf("Q6_K", QK_K, 210, read_q6_k, 6, 16),
        # GGUF's 16-bit kinds, kept in 16 bits
        Format("F16", HalfLinear, linear_rows_op, dtype=torch.float16),
        Format("BF16", HalfLinear, linear_rows_op, dtype=torch.bfloat16),
    )
}
WEIGHT_FORMATS: tuple[WeightFormat, ...] = tuple(
    cast(WeightFormat, n) for n, f in FORMATS.items() if f.blocks is None and f.dtype is None
)
PACKED_KINDS: tuple[str, ...] = tuple(n for n, f in FORMATS.items() if f.blocks is not None)
HALF_KINDS: dict[str, torch.dtype] = {n: f.dtype for n, f in FORMATS.items() if f.dtype is not None}


def check_weights(name: str, weights: object) -> WeightFormat:
    """``weights`` as a :data:`WeightFormat`; a ValueError naming ``name`` and the choices."""
    if not isinstance(weights, str) or weights not in WEIGHT_FORMATS:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, WEIGHT_FORMATS))}, got {weights!r}"
        )
    return cast(WeightFormat, weights)


def repack(
    raw: np.ndarray, kind: str, shape: tuple[int, int], *, name: str = "the tensor"
) -> PackedWeight:
    """The bytes ``raw`` (rows, bytes a row) of a GGUF tensor of type ``kind`` and torch shape
    ``shape`` (N, K) as a :class:`PackedWeight` (:meth:`GGUFBlocks.repack`; a ValueError for a
    kind that is not packed)."""
    f = FORMATS.get(kind)
    if f is None or f.blocks is None:
        raise ValueError(f"GGUF type {kind} is not packed by dikkat; packed: {PACKED_KINDS}")
    return f.blocks.repack(raw, shape, name=name)
