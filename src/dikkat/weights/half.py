"""Weights a file holds in 16 bits (GGUF's F16 and BF16), kept in 16 bits: a linear layer and a
token embedding that widen them to fp32 as they are read.

Every fp16 and bf16 value is an fp32 value, so widening is exact, and the arithmetic is fp32's:
a product here is what the same weight dequantised to fp32 (``load(..., weights="fp32")``,
transformers' reading of the file) gives, up to the order of the sums. What changes is what a
decode step reads: two bytes a weight instead of four, and a model held in its file's size.
The product is dikkat's native kernel (``linear_rows``, :mod:`dikkat.kernels`), which reads the
16-bit rows for a few rows of input and, for more (a prompt's prefill), widens a slice of the
weight at a time for oneDNN's fp32 product; without the kernel, PyTorch widens slices for
``F.linear``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.kernels import linear_rows_op
from dikkat.weights.held import HeldWeight, InferenceLinear

__all__ = ["HALF_DTYPES", "HalfEmbedding", "HalfLinear", "is_half"]

# the 16-bit dtypes kept as they are
HALF_DTYPES = (torch.float16, torch.bfloat16)
_SLICE_BYTES = 8 << 20  # fp32 bytes of a weight widened at a time without the kernel


def is_half(t: object) -> bool:
    """Whether ``t`` is a 16-bit matrix (fp16 or bf16, 2-D) that these layers keep."""
    return isinstance(t, Tensor) and t.dtype in HALF_DTYPES and t.dim() == 2


def _checked(name: str, table: Tensor) -> Tensor:
    if not is_half(table) or not table.is_cpu:
        shown = f"{table.dtype} {tuple(table.shape)} on {table.device}" if isinstance(
            table, Tensor) else type(table).__name__  # fmt: skip
        raise ValueError(f"{name} must be a 2-D fp16 or bf16 tensor on the CPU, got {shown}")
    return table.contiguous()


class HalfLinear(InferenceLinear):
    """A linear layer whose weight (N, K) is held in fp16 or bf16, as the file held it, and
    multiplied in fp32 (see the module's notes); inputs and outputs are fp32. The weight may be
    held in ``parts`` stacked by rows (q, k and v; gate and up), each where it lies (the file's
    map: nothing is copied to join them), multiplied one after another. Its ``weights_format``
    is "gguf": as a GGUF file held it."""

    weights_format = "gguf"

    def __init__(
        self, parts: Tensor | Sequence[Tensor], bias: nn.Parameter | None, batched: bool = False
    ) -> None:
        given = [parts] if isinstance(parts, Tensor) else list(parts)
        if not given:
            raise ValueError("a 16-bit layer needs at least one table")
        tables = [_checked(f"parts[{i}]", t) for i, t in enumerate(given)]
        kinds = {(t.dtype, t.shape[1]) for t in tables}
        if len(kinds) > 1:
            shown = [f"{t.dtype} {tuple(t.shape)}" for t in tables]
            raise ValueError(f"parts must share one dtype and their columns, got {shown}")
        rows = sum(t.shape[0] for t in tables)
        super().__init__(torch.empty(rows, tables[0].shape[1], device="meta"), bias, batched)
        self._device = tables[0].device
        self.parts = tuple(tables)
        ends = torch.tensor([t.shape[0] for t in tables]).cumsum(0).tolist()
        self._spans = list(zip([0, *ends[:-1]], ends, strict=True))
        self._native = linear_rows_op() is not None

    @property
    def table(self) -> Tensor:
        """The weight, where it is held in one part (a tied output layer's: the token table)."""
        if len(self.parts) != 1:
            raise ValueError(f"this layer's weight is held in {len(self.parts)} parts")
        return self.parts[0]

    @property
    def weight(self) -> HeldWeight:
        shape = torch.Size((self.out_features, self.in_features))
        return HeldWeight(self.weights_format, shape, torch.float32, self._device)

    @property
    def nbytes(self) -> int:
        b = self.bias
        held = sum(t.numel() * 2 for t in self.parts)
        return held + (0 if b is None else b.numel() * b.element_size())

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        autograd = x.requires_grad and torch.is_grad_enabled()  # the kernel has no backward
        native = self._native and x.dtype == torch.float32 and not autograd
        flat = x.reshape(-1, self.in_features)
        blocks = self._blocks(start, stop)
        if native and len(blocks) > 1 and not torch.compiler.is_compiling():
            # each part's product written into its columns of one output: no joining copy
            y = flat.new_empty(flat.shape[0], stop - start)
            for lo, hi, w, bias in blocks:
                columns = y[:, lo - start : hi - start]
                torch.ops.dikkat_native.linear_rows_into(flat, w, bias, columns)
            return y.view(*x.shape[:-1], stop - start)
        product = torch.ops.dikkat_native.linear_rows if native else _widened
        outs = [product(flat, w, bias) for _, _, w, bias in blocks]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y.view(*x.shape[:-1], stop - start)

    def _blocks(self, start: int, stop: int) -> list[tuple[int, int, Tensor, Tensor | None]]:
        """The output features [lo, hi) each part gives of [start, stop), its rows and bias."""
        blocks = []
        for (a, b), table in zip(self._spans, self.parts, strict=True):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                w = table if (lo, hi) == (a, b) else table[lo - a : hi - a]
                blocks.append((lo, hi, w, None if self.bias is None else self.bias[lo:hi]))
        return blocks

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kind={_kind(self.parts[0])!r}, parts={len(self.parts)}"


def _widened(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ wᵀ + bias`` with PyTorch operations, ``w`` widened to x's dtype a slice of rows at
    a time (a few MB beside the 16-bit weight, not a whole copy)."""
    N, K = w.shape
    step = max(16, _SLICE_BYTES // (4 * max(K, 1)))
    parts = [
        F.linear(x, w[n : n + step].to(x.dtype), None if bias is None else bias[n : n + step])
        for n in range(0, N, step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class HalfEmbedding(nn.Module):
    """A token embedding (V, C) held in fp16 or bf16: the rows of the ids looked up are widened to
    fp32. Its ``weight`` shows the shape, dtype and device (for the model's input checks); the
    table itself is ``table``, which a tied output layer (:class:`HalfLinear`) shares."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = _checked("table", table)
        self.num_embeddings, self.embedding_dim = self.table.shape

    @property
    def weight(self) -> HeldWeight:
        return HeldWeight("gguf", self.table.shape, torch.float32, self.table.device)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.table).float()

    def _apply(self, fn: Any, recurse: bool = True) -> HalfEmbedding:
        raise TypeError("a 16-bit embedding cannot be moved or converted: load the model again")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={_kind(self.table)!r}"


def _kind(table: Tensor) -> str:
    """The GGUF kind name of a 16-bit table."""
    return "F16" if table.dtype == torch.float16 else "BF16"
