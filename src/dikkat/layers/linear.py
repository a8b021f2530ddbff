"""``Linear``: ``nn.Linear`` plus an inference fast path with weights repacked for the CPU.

Decoding one token multiplies a single row by every weight matrix of the model, so its speed is
the speed of reading the weights from memory. PyTorch's default CPU kernel for ``x @ Wᵀ`` with
one row reads them well below the memory's bandwidth; the same product through oneDNN with the
weight reordered into oneDNN's blocked layout comes close to it (BENCHMARKS.md, "Generation").
:func:`packed_for_inference` switches that path on for a ``with`` block (generation uses it); the
reordered copy is rebuilt whenever the weight changes, so it is never stale. The same block can
multiply through a bf16 or an int8 copy of the weights instead (:mod:`dikkat.layers.quantized`),
which halves or quarters the bytes each token reads.

:class:`LinearRows` is a block of a ``Linear``'s output features used on its own, e.g. the
queries of a fused q/k/v projection applied to x alone (cross-attention); it owns no parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.core.tuning import for_device
from dikkat.layers.quantized import (
    Int8Weight,
    W8A8Weight,
    WeightFormat,
    check_weights,
    int8_linear,
    quantize_int8,
    quantize_w8a8,
    w8a8_linear,
)
from dikkat.validate import check_bool, check_int


@functools.cache  # asked on every product inside a block; the build does not change
def onednn_linear_available() -> bool:
    """Whether this PyTorch build has the oneDNN linear ops that :func:`packed_for_inference`
    uses; where it has not, that block is a no-op."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


_Slot = tuple[WeightFormat, int, int, int]


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict and math) with optional inference copies.

    Inside :func:`packed_for_inference`, with autograd off, ``forward`` multiplies by a copy of
    the weight in the block's format (:mod:`dikkat.layers.quantized`): "fp32" runs oneDNN's
    linear on a reordered copy (on the CPU, for an input of the weight's dtype), "bf16" the same
    on a bf16 copy (the input rounded to bf16, the output back in its dtype), "int8" the int8
    weight-only product. A copy is made on first use and lives until the outermost such block
    ends; inside the block it is rebuilt when the weight's version counter moves (any in-place
    write through autograd's view of it). Nothing is kept between blocks: an optimizer step may
    write the weights without moving that counter (PyTorch's fused ``AdamW(fused=True)`` does),
    so no later check could tell. The parameters themselves are never changed.
    """

    _formats: tuple[WeightFormat, ...] = ()  # the formats of the open blocks, innermost last
    _batched: tuple[bool, ...] = ()  # and whether each block expects batches of many rows
    # inference copies by (format, start, stop, rows laid out for) rows of the weight:
    # (weight key, copy)
    _copies: dict[_Slot, tuple[tuple[int, int, torch.dtype], Copy]] | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        # nn.Linear accepts 0 features (an empty product: every output is the bias)
        check_int("in_features", in_features)
        check_int("out_features", out_features)
        check_bool("bias", bias)
        super().__init__(in_features, out_features, bias, device, dtype)

    def _weight_key(self) -> tuple[int, int, torch.dtype]:
        w = self.weight
        return (w._version, w.data_ptr(), w.dtype)  # any in-place update bumps _version

    def inference_copy(self, weights: WeightFormat, start: int, stop: int, rows: int = 1) -> Copy:
        """The copy of rows [start, stop) of the weight (and bias) that ``weights`` multiplies
        by, made now or kept from earlier in the open block; a oneDNN-packed copy is laid out
        for products of ``rows`` input rows (each layout is fastest near its own row count)."""
        key = self._weight_key()
        if self._copies is None:
            self._copies = {}
        if not _packs(weights, self.weight):
            rows = 1  # only a oneDNN-packed copy has a layout; others are kept once
        slot = (weights, start, stop, rows)
        kept = self._copies.get(slot)
        if kept is None or kept[0] != key:
            with torch.no_grad():
                w = self.weight.detach()[start:stop]
                b = None if self.bias is None else self.bias.detach()[start:stop]
                kept = (key, _make_copy(weights, w, b, slot[3]))
            self._copies[slot] = kept
        return kept[1]

    def packed_weight(self) -> Tensor:
        """The oneDNN-packed fp32 copy of the weight ("fp32" :meth:`inference_copy`)."""
        return self.packed_rows(0, self.out_features)

    def packed_rows(self, start: int, stop: int) -> Tensor:
        """The oneDNN-packed fp32 copy of rows [start, stop) of the weight."""
        copy = self.inference_copy("fp32", start, stop)
        assert isinstance(copy, FloatCopy)  # what "fp32" makes
        return copy.weight

    def release_packed(self) -> None:
        self._copies = None

    @property
    def packed_copies(self) -> frozenset[tuple[int, int]]:
        """The row blocks [start, stop) of the weight held as inference copies now (in any
        format): (0, out_features) for the whole weight (``forward``), others for
        :class:`LinearRows` blocks. Empty until something is copied, and after
        :meth:`release_packed`."""
        return frozenset((a, b) for _, a, b, _ in self._copies or ())

    @property
    def use_packed(self) -> bool:
        """Whether a :func:`packed_for_inference` block is open around this layer."""
        return bool(self._formats)

    @property
    def weights_format(self) -> WeightFormat | None:
        """The format the innermost open block multiplies in; None outside every block."""
        return self._formats[-1] if self._formats else None

    def forward(self, x: Tensor) -> Tensor:
        if self._formats and not torch.is_grad_enabled():
            return self._run_copy(x, 0, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features [start, stop) alone: ``x @ W[start:stop]ᵀ + b[start:stop]``, the same
        numbers as those columns of ``forward(x)`` up to rounding (copied like ``forward``)."""
        bias = None if self.bias is None else self.bias[start:stop]
        if self._formats and not torch.is_grad_enabled():
            return self._run_copy(x, start, stop, bias)
        return F.linear(x, self.weight[start:stop], bias)

    def _run_copy(self, x: Tensor, start: int, stop: int, bias: Tensor | None) -> Tensor:
        weights = self._formats[-1]
        if weights == "fp32":
            weight = self.weight
            if (
                x.numel() <= x.shape[-1] * for_device(x.device).plain_gemv_max_rows
                or x.dtype != weight.dtype
                or not _onednn_serves(weight)
            ):  # as outside the block
                whole = start == 0 and stop == self.out_features
                return F.linear(x, weight if whole else weight[start:stop], bias)
        rows = _BATCH_ROWS if self._batched[-1] and x.numel() > 2 * x.shape[-1] else 1
        copy = self.inference_copy(weights, start, stop, rows)
        if isinstance(copy, W8A8Weight):  # its bias is packed with it
            return w8a8_linear(x, copy)
        if isinstance(copy, Int8Copy):
            return int8_linear(x, copy.weight, None if bias is None else copy.bias)
        dtype = copy.weight.dtype
        h = x if x.dtype == dtype else x.to(dtype)
        if copy.packed:
            y = torch.ops.mkldnn._linear_pointwise(h, copy.weight, copy.bias, "none", [], "")
        else:
            y = F.linear(h, copy.weight, copy.bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)


@dataclass(frozen=True)
class FloatCopy:
    """A weight (and bias) copy in a float dtype; ``packed``: reordered for oneDNN's linear."""

    weight: Tensor
    bias: Tensor | None
    packed: bool


@dataclass(frozen=True)
class Int8Copy:
    """A weight as int8 with per-channel scales, and its bias in the weight's dtype."""

    weight: Int8Weight
    bias: Tensor | None


Copy = FloatCopy | Int8Copy | W8A8Weight

# the rows a batched block's second packed copy is laid out for (BENCHMARKS.md, Generation, the
# AVX2-only EPYC: "Batches"; `python benchmarks/generation.py` measures it again)
_BATCH_ROWS = 8


def _onednn_serves(w: Tensor) -> bool:
    return _onednn_packs(w.device, w.dtype)


def _onednn_packs(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        onednn_linear_available()
        and device.type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and _onednn_bf16()))
    )


def _packs(weights: WeightFormat, w: Tensor) -> bool:
    """Whether :func:`_make_copy` packs ``w`` for oneDNN in the format ``weights``."""
    if weights not in ("fp32", "bf16"):
        return False
    return _onednn_packs(w.device, torch.bfloat16 if weights == "bf16" else w.dtype)


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); without
    them its weight reorder refuses bf16, and a bf16 copy is multiplied by plain ``F.linear``."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _make_copy(weights: WeightFormat, w: Tensor, b: Tensor | None, rows: int) -> Copy:
    if weights == "int8":
        return Int8Copy(quantize_int8(w), b)
    if weights == "w8a8":
        return quantize_w8a8(w, b)
    if weights == "bf16":
        w, b = w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16)
    if _onednn_serves(w):
        return FloatCopy(torch.ops.mkldnn._reorder_linear_weight(w, rows), b, packed=True)
    return FloatCopy(w.contiguous(), b, packed=False)


class LinearRows(nn.Module):
    """Output features [start, stop) of a :class:`Linear` ``source``, used as a linear layer.

    Owns no parameters: ``weight`` and ``bias`` are views of the source's rows, so the state
    dict, the optimizer and the packed copies all stay the source's (and in-place writes to
    ``weight`` under ``torch.no_grad()`` write the source). ``forward`` multiplies by those rows
    only, packed inside :func:`packed_for_inference` like the source.

    >>> qkv = Linear(8, 24)
    >>> k = LinearRows(qkv, 8, 16)
    >>> k.weight.shape, k(torch.randn(2, 8)).shape
    (torch.Size([8, 8]), torch.Size([2, 8]))
    """

    source: Linear

    def __init__(self, source: Linear, start: int, stop: int) -> None:
        super().__init__()
        if not isinstance(source, Linear):
            raise TypeError(f"source must be a dikkat Linear, got {type(source).__name__}")
        check_int("start", start, at_least=0)
        check_int("stop", stop, at_least=start)
        if stop > source.out_features:
            raise ValueError(
                f"rows [{start}, {stop}) do not fit the {source.out_features} output features"
            )
        # not a submodule: the source is registered once, where it is owned
        object.__setattr__(self, "source", source)
        self.start, self.stop = start, stop

    @property
    def in_features(self) -> int:
        return self.source.in_features

    @property
    def out_features(self) -> int:
        return self.stop - self.start

    @property
    def weight(self) -> Tensor:
        return self.source.weight[self.start : self.stop]  # (out_features, in_features)

    @property
    def bias(self) -> Tensor | None:
        b = self.source.bias
        return None if b is None else b[self.start : self.stop]

    def forward(self, x: Tensor) -> Tensor:
        return self.source.forward_rows(x, self.start, self.stop)

    def extra_repr(self) -> str:
        s = self.source
        return f"rows {self.start}:{self.stop} of Linear({s.in_features}, {s.out_features})"


@contextmanager
def packed_for_inference(
    model: nn.Module, weights: WeightFormat | None = None, *, batched: bool | None = None
) -> Iterator[nn.Module]:
    """Within the block, every :class:`Linear` of ``model`` multiplies (with autograd off)
    through a copy of its weight in the format ``weights`` (:mod:`dikkat.layers.quantized`):

    - "fp32": the weight as it is, reordered for oneDNN on the CPU (a no-op elsewhere, or where
      oneDNN is not available); a product of one or two rows (decoding) multiplies the weight
      itself, which is faster there (``plain_gemv_max_rows`` in :mod:`dikkat.core.tuning`);
    - "bf16": a bf16 copy; the input is rounded to bf16 for the product, the output comes back
      in the input's dtype;
    - "int8": per-output-channel int8 weights with fp32 scales (weight-only; see
      :func:`dikkat.layers.quantized.int8_linear`);
    - "w8a8": the same int8 weights times 8-bit inputs rounded on the fly, through FBGEMM, on
      x86 CPUs (see :func:`dikkat.layers.quantized.w8a8_linear`);
    - None: the format of the enclosing block, "fp32" when there is none.

    oneDNN lays a packed weight out for a number of input rows. By default every product uses
    one copy laid out for one row (decoding one sequence; a prompt's prefill makes do with it).
    ``batched=True`` (a server decoding many sequences at once) adds a second copy, laid out
    for :data:`_BATCH_ROWS` rows, for the products of more than two rows: twice the memory,
    faster batches. None: as the enclosing block, False when there is none.

    The model's parameters are never changed; everything else (embeddings, norms, attention,
    the KV cache) runs in the model's dtype. The first use inside the block makes the copies,
    which costs about one pass over the weights; they live until the outermost block ends,
    then they are freed. Blocks nest, so to prepare once for many ``generate`` calls (a server,
    a benchmark), hold one block open around them and do not change the weights inside it.

    >>> model = Linear(32, 8)
    >>> with torch.no_grad(), packed_for_inference(model, "int8"):
    ...     model(torch.randn(2, 32)).shape
    torch.Size([2, 8])
    """
    if weights is not None:
        weights = check_weights("weights", weights)
    if batched is not None:
        check_bool("batched", batched)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for m in layers:
        m._formats = (*m._formats, weights or m.weights_format or "fp32")
        m._batched = (
            *m._batched,
            m._batched[-1] if batched is None and m._batched else bool(batched),
        )
    try:
        yield model
    finally:
        for m in layers:
            m._formats = m._formats[:-1]
            m._batched = m._batched[:-1]
            if not m._formats:
                m.release_packed()


def release_packed(model: nn.Module) -> None:
    """Free the packed weight copies of every :class:`Linear` in ``model``."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.release_packed()
