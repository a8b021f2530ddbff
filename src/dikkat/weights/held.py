"""The base of every layer of an inference copy (:func:`dikkat.weights.inference_model`): a linear
layer holding its weight in one format, and what it shows as its ``weight``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = ["BATCH_ROWS", "HeldWeight", "InferenceLinear"]

# the rows a batched copy's second packed layout is laid out for (BENCHMARKS.md, Generation, the
# AVX2-only EPYC: "Batches"; `python benchmarks/generation.py` measures it again)
BATCH_ROWS = 8


@dataclass(frozen=True)
class HeldWeight:
    """What a layer holding its weight as bf16, int8 or w8a8 shows as its ``weight``: the shape
    (N, K), and the dtype and device of the inputs it multiplies and the outputs it returns
    (the model's), which is what the layers' input checks read. It holds no numbers; the
    product goes through the layer."""

    weights_format: str  # a name in dikkat.weights.formats.FORMATS
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


class InferenceLinear(nn.Module):
    """A :class:`~dikkat.layers.Linear` of an inference copy: its weight held in one format
    (one subclass per format), multiplied with autograd off, in the input's dtype.

    Its parameters (``bias``; fp32's ``weight``) do not require gradients. It cannot be moved
    or converted (``.to``, ``.double()``): convert the model, then copy it again. Copies that
    depend on the rows multiplied (oneDNN's packed layouts, FBGEMM's packed rows) are made on
    first use, per block of rows: the whole weight for ``forward``, a :class:`LinearRows`'s
    block for ``forward_rows``.
    """

    # a WeightFormat (dikkat.weights.formats), or "gguf": as a GGUF file held it
    weights_format: ClassVar[str]
    # attributes a product fills as it runs (copies made on first use), not the weight itself:
    # what describes the layer leaves them out (dikkat.models.aot_step)
    made_on_use: ClassVar[tuple[str, ...]] = ("_copies",)

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, batched: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.batched = batched
        self.register_parameter("bias", bias)
        self._dtype, self._device = weight.dtype, weight.device
        # copies made on first use, by (start, stop, rows laid out for) rows of the weight
        self._copies: dict[tuple[int, int, int], Any] = {}

    @property
    def copies(self) -> frozenset[tuple[int, int, int]]:
        """The copies made so far on first use, as (start, stop, rows): the block of rows
        [start, stop) of the weight, laid out for products of ``rows`` input rows."""
        return frozenset(self._copies)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held, and of the bias: what a product reads (its copies made
        on first use aside)."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_rows(x, 0, self.out_features)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features [start, stop) alone (a :class:`LinearRows` block)."""
        raise NotImplementedError

    def _bias(self, start: int, stop: int) -> Tensor | None:
        b = self.bias
        return b if b is None or (start, stop) == (0, self.out_features) else b[start:stop]

    def _rows(self, x: Tensor) -> int:
        """The layout a product of x's rows uses: the batched one for more than two rows."""
        return BATCH_ROWS if self.batched and x.numel() > 2 * x.shape[-1] else 1

    def _copy(self, start: int, stop: int, rows: int, make: Any) -> Any:
        key = (start, stop, rows)
        kept = self._copies.get(key)
        if kept is None:  # two threads may both make it: the same numbers, one is kept
            with torch.no_grad():
                kept = self._copies[key] = make()
        return kept

    def _apply(self, fn: Any, recurse: bool = True) -> InferenceLinear:
        raise TypeError(
            f"an inference copy's {self.weights_format} layer cannot be moved or converted: "
            "convert the model, then make a new copy with inference_model"
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weights={self.weights_format!r}, "
            f"batched={self.batched}"
        )
