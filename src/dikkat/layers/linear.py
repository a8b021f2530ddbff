"""``Linear``: ``nn.Linear`` plus an inference fast path with weights repacked for the CPU.

Decoding one token multiplies a single row by every weight matrix of the model, so its speed is
the speed of reading the weights from memory. PyTorch's default CPU kernel for ``x @ Wᵀ`` with
one row reads them well below the memory's bandwidth; the same product through oneDNN with the
weight reordered into oneDNN's blocked layout comes close to it (BENCHMARKS.md, "Generation").
:func:`packed_for_inference` switches that path on for a ``with`` block (generation uses it); the
reordered copy is rebuilt whenever the weight changes, so it is never stale.

:class:`LinearRows` is a block of a ``Linear``'s output features used on its own, e.g. the
queries of a fused q/k/v projection applied to x alone (cross-attention); it owns no parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.validate import check_bool, check_int


def onednn_linear_available() -> bool:
    """Whether this PyTorch build has the oneDNN linear ops that :func:`packed_for_inference`
    uses; where it has not, that block is a no-op."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict and math) with an optional packed weight.

    Inside :func:`packed_for_inference`, with autograd off, ``forward`` runs oneDNN's linear on a
    reordered copy of the weight. The copy is made on first use and lives until the outermost
    such block ends (it costs as much memory as the weight); inside the block it is rebuilt when
    the weight's version counter moves (any in-place write through autograd's view of it).
    Nothing is kept between blocks: an optimizer step may write the weights without moving that
    counter (PyTorch's fused ``AdamW(fused=True)`` does), so no later check could tell.
    """

    _pack_depth: int = 0  # open packed_for_inference blocks around this layer
    _packed: Tensor | None = None
    _packed_key: tuple[int, int, torch.dtype] | None = None
    # packed copies of row blocks (LinearRows), keyed by (start, stop)
    _packed_rows: dict[tuple[int, int], tuple[tuple[int, int, torch.dtype], Tensor]] | None = None

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

    def packed_weight(self) -> Tensor:
        key = self._weight_key()
        if self._packed is None or self._packed_key != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self._packed_key = key
        return self._packed

    def packed_rows(self, start: int, stop: int) -> Tensor:
        """The packed copy of rows [start, stop) of the weight (kept like :meth:`packed_weight`)."""
        key = self._weight_key()
        if self._packed_rows is None:
            self._packed_rows = {}
        kept = self._packed_rows.get((start, stop))
        if kept is None or kept[0] != key:
            with torch.no_grad():
                rows = self.weight.detach()[start:stop]
                kept = (key, torch.ops.mkldnn._reorder_linear_weight(rows, 1))
            self._packed_rows[(start, stop)] = kept
        return kept[1]

    def release_packed(self) -> None:
        self._packed, self._packed_key, self._packed_rows = None, None, None

    @property
    def packed_copies(self) -> frozenset[tuple[int, int]]:
        """The row blocks [start, stop) of the weight held as packed copies now: (0,
        out_features) for the whole weight (``forward``), others for :class:`LinearRows`
        blocks. Empty until something is packed, and after :meth:`release_packed`."""
        held = set() if self._packed_rows is None else set(self._packed_rows)
        if self._packed is not None:
            held.add((0, self.out_features))
        return frozenset(held)

    @property
    def use_packed(self) -> bool:
        """Whether a :func:`packed_for_inference` block is open around this layer."""
        return self._pack_depth > 0

    def _runs_packed(self, x: Tensor) -> bool:
        return self.use_packed and not torch.is_grad_enabled() and x.dtype == self.weight.dtype

    def forward(self, x: Tensor) -> Tensor:
        if self._runs_packed(x):
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight(), self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features [start, stop) alone: ``x @ W[start:stop]ᵀ + b[start:stop]``, the same
        numbers as those columns of ``forward(x)`` up to rounding (packed like ``forward``)."""
        bias = None if self.bias is None else self.bias[start:stop]
        if self._runs_packed(x):
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_rows(start, stop), bias, "none", [], ""
            )
        return F.linear(x, self.weight[start:stop], bias)


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


def _packable(m: nn.Module) -> bool:
    return (
        isinstance(m, Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype in (torch.float32, torch.bfloat16)
    )


@contextmanager
def packed_for_inference(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every :class:`Linear` of ``model`` on the CPU (fp32/bf16) multiplies
    through oneDNN with a reordered copy of its weight. A no-op where oneDNN is not available.

    The first use inside the block packs the weights, which costs about one pass over them; the
    copies live until the outermost block ends, then they are freed. Blocks nest, so to pack once
    for many ``generate`` calls (a server, a benchmark), hold one block open around them and do
    not change the weights inside it.
    """
    layers = [m for m in model.modules() if _packable(m)] if onednn_linear_available() else []
    for m in layers:
        m._pack_depth += 1
    try:
        yield model
    finally:
        for m in layers:
            m._pack_depth -= 1
            if m._pack_depth == 0:
                m.release_packed()


def release_packed(model: nn.Module) -> None:
    """Free the packed weight copies of every :class:`Linear` in ``model``."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.release_packed()
