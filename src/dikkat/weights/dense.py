"""The layers of the formats that hold a weight whole, row by row: fp32 packed for oneDNN, bf16,
per-output-channel int8 and w8a8 (the block formats are :mod:`dikkat.weights.packed_layers`).

Notation: ``N`` output features, ``K`` input features.

Decoding one token multiplies a single row by every weight matrix of the model, so its speed is
the speed of reading the weights from memory. PyTorch's default CPU kernel for ``x @ Wᵀ`` with
one row reads them well below the memory's bandwidth; the same product through oneDNN with the
weight reordered into oneDNN's blocked layout comes close to it (BENCHMARKS.md, "Generation").
A bf16 or an int8 copy of the weights (:mod:`dikkat.weights.int8`) halves or quarters the
bytes each token reads.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.core.tuning import for_device
from dikkat.kernels import linear_rows_op
from dikkat.weights.held import HeldWeight, InferenceLinear
from dikkat.weights.int8 import (
    Int8Weight,
    W8A8Weight,
    check_w8a8,
    int8_linear,
    pack_w8a8,
    quantize_int8,
    rows_of,
    w8a8_linear,
)

__all__ = ["Bf16Linear", "Fp32Linear", "Int8Linear", "W8A8Linear", "onednn_linear_available"]


@functools.cache  # asked on every product; the build does not change
def onednn_linear_available() -> bool:
    """Whether this PyTorch build has the oneDNN linear ops that the packed fp32 and bf16 copies
    use; where it has not, those copies multiply with ``F.linear``."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); without
    them its weight reorder refuses bf16, and a bf16 copy is multiplied by plain ``F.linear``."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _onednn_packs(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        onednn_linear_available()
        and device.type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and _onednn_bf16()))
    )


class Fp32Linear(InferenceLinear):
    """The weight as it is (a snapshot, in the model's dtype), and oneDNN-packed copies of it.

    On the CPU, one fp32 row (decoding one sequence) times a weight whose rows are contiguous
    is multiplied by dikkat's native kernel (:func:`dikkat.kernels.linear_rows_op`; the
    layer's construction builds the kernels, once per machine), which reads the weight closer to
    the memory's bandwidth than PyTorch's product (``benchmarks/decode_parts.py``).
    Where oneDNN serves the dtype, a product of more rows than ``plain_gemv_max_rows``
    (:mod:`dikkat.core.tuning`) multiplies a packed copy; fewer rows (decoding two sequences),
    another dtype, or another device multiply the weight itself with ``F.linear``, which is
    faster there. So does a product ``torch.compile`` traces with more rows, or a symbolic
    number of them: a choice by row count would tie its graph to one batch size.
    """

    weights_format = "fp32"

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, batched: bool) -> None:
        super().__init__(weight, bias, batched)
        self.weight = weight
        self._packs = _onednn_packs(weight.device, weight.dtype)
        self._native = (
            weight.dtype == torch.float32
            and weight.is_cpu
            and weight.stride(-1) == 1  # the kernel reads rows in place
            and linear_rows_op() is not None
        )

    @property
    def nbytes(self) -> int:
        return _size(self.weight) + _size(self.bias)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        whole = (start, stop) == (0, self.out_features)
        bias = self._bias(start, stop)
        w = self.weight if whole else self.weight[start:stop]
        autograd = x.requires_grad and torch.is_grad_enabled()  # no backward in the ops below
        if self._native and _one_row(x) and x.dtype == torch.float32 and not autograd:
            y = linear_rows_op()(x.reshape(1, -1), w, bias)  # type: ignore[misc]
            return y.view(*x.shape[:-1], stop - start)
        if (
            torch.compiler.is_compiling()  # first: the row count below would be a guard
            or x.numel() <= x.shape[-1] * for_device(x.device).plain_gemv_max_rows
            or x.dtype != self._dtype
            or not self._packs
            or autograd
        ):
            return F.linear(x, w, bias)
        rows = self._rows(x)
        packed = self._copy(start, stop, rows, lambda: _reorder(w, rows))
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _one_row(x: Tensor) -> bool:
    """Whether ``x`` (..., K) is one row, by sizes that are plain ints (a graph that
    torch.compile traces with a symbolic batch keeps to ``F.linear``)."""
    sizes = x.shape[:-1]
    return all(isinstance(n, int) for n in sizes) and math.prod(sizes) == 1


class Bf16Linear(InferenceLinear):
    """The weight and bias rounded to bf16 (packed for oneDNN where it has bf16 kernels); the
    input is rounded to bf16 for the product, the output comes back in the input's dtype
    (with ``F.linear`` where ``torch.compile`` traces it, as :class:`Fp32Linear` does)."""

    weights_format = "bf16"

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, batched: bool) -> None:
        super().__init__(weight, bias, batched)
        self._w16 = weight.detach().to(torch.bfloat16).contiguous()  # (N, K)
        self._b16 = None if bias is None else bias.detach().to(torch.bfloat16)
        self._packs = _onednn_packs(weight.device, torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return _size(self._w16) + _size(self._b16)

    @property
    def weight(self) -> HeldWeight:
        return HeldWeight("bf16", self._w16.shape, self._dtype, self._device)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        h = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        b = None if self._b16 is None else self._b16[start:stop]
        w = self._w16[start:stop]
        if self._packs and not torch.compiler.is_compiling():
            rows = self._rows(x)
            packed = self._copy(start, stop, rows, lambda: _reorder(w, rows))
            y = torch.ops.mkldnn._linear_pointwise(h, packed, b, "none", [], "")
        else:
            y = F.linear(h, w, b)
        return y if y.dtype == x.dtype else y.to(x.dtype)


class Int8Linear(InferenceLinear):
    """The weight as per-output-channel int8 with fp32 scales, the bias as it is: the product
    of :func:`~dikkat.weights.int8.int8_linear`. A block of rows is a view of the whole
    (each row has its own scale, so it is what quantising the block alone gives)."""

    weights_format = "int8"

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, batched: bool) -> None:
        super().__init__(weight, bias, batched)
        self._q: Int8Weight = quantize_int8(weight)

    @property
    def nbytes(self) -> int:
        return self._q.nbytes + _size(self.bias)

    @property
    def weight(self) -> HeldWeight:
        return HeldWeight(self.weights_format, self._q.values.shape, self._dtype, self._device)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        whole = (start, stop) == (0, self.out_features)
        q = self._q if whole else rows_of(self._q, start, stop)
        return int8_linear(x, q, self._bias(start, stop))


class W8A8Linear(Int8Linear):
    """The int8 weight of :class:`Int8Linear` times inputs rounded to 8 bits on the fly, through
    FBGEMM (x86 CPUs; :func:`~dikkat.weights.int8.w8a8_linear`). Each block of rows
    multiplied is packed, with its bias, on first use."""

    weights_format = "w8a8"

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, batched: bool) -> None:
        check_w8a8(weight)  # here, not at the first product
        super().__init__(weight, bias, batched)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        packed: W8A8Weight = self._copy(start, stop, 1, lambda: self._pack(start, stop))
        return w8a8_linear(x, packed)

    def _pack(self, start: int, stop: int) -> W8A8Weight:
        b = self.bias
        return pack_w8a8(rows_of(self._q, start, stop), None if b is None else b[start:stop])


def _size(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _reorder(w: Tensor, rows: int) -> Tensor:
    """``w`` (N, K) in oneDNN's blocked layout for products of ``rows`` input rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)
