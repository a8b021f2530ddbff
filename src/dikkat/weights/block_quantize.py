"""dikkat's own block formats for any weight: Q8_0 and Q4_0 as llama.cpp quantises them
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), packed as
:class:`~dikkat.weights.packed.PackedWeight` and multiplied by the same kernel as a GGUF file's
blocks; ``inference_model(model, "q8")`` and ``"q4"`` give any dikkat model these layers."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dikkat.weights.bits import pack
from dikkat.weights.packed import GROUP, PackedWeight
from dikkat.weights.packed_layers import PackedLinear

__all__ = ["Q4Linear", "Q8Linear", "quantize_q4", "quantize_q8"]


def _check_weight(weight: Tensor) -> Tensor:
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D floating-point tensor (N, K), got {shape}")
    if weight.shape[1] % GROUP:
        raise ValueError(
            f"a packed weight's rows must be whole blocks of {GROUP} values, got "
            f"{weight.shape[1]} input features"
        )
    return weight.detach().float()


def quantize_q8(weight: Tensor) -> PackedWeight:
    """``weight`` (N, K) as Q8_0: per block of 32, d = max |w| / 127, q = round(w / d) + 128
    (|w − dequantised| ≤ d / 2)."""
    w = _check_weight(weight)
    N, K = w.shape
    blocks = w.view(N, K // GROUP, GROUP)
    d = blocks.abs().amax(dim=-1) / 127
    q = torch.where(d[..., None] > 0, torch.round(blocks / d[..., None]), 0.0) + 128
    return PackedWeight(q.to(torch.uint8).view(N, K), d, None, 128, 8, GROUP, "q8")


def quantize_q4(weight: Tensor) -> PackedWeight:
    """``weight`` (N, K) as Q4_0: per block of 32, the value of largest magnitude m maps to −8,
    d = m / −8, q = clamp(round(w / d) + 8, 0, 15) (|w − dequantised| ≤ |d| / 2 but at the
    block's far end, where the one-sided range clips it)."""
    w = _check_weight(weight)
    N, K = w.shape
    blocks = w.view(N, K // GROUP, GROUP)
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # (N, K/32, 1)
    d = largest / -8
    q = torch.where(d != 0, torch.round(blocks / d), 0.0).add_(8).clamp_(0, 15)
    return PackedWeight(pack(q.view(N, K), 4), d[..., 0], None, 8, 4, GROUP, "q4")


class Q8Linear(PackedLinear):
    """A weight quantised as Q8_0 (:func:`quantize_q8`): ``inference_model(model, "q8")``."""

    weights_format = "q8"

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, batched: bool) -> None:
        super().__init__(quantize_q8(weight), bias, batched)


class Q4Linear(PackedLinear):
    """A weight quantised as Q4_0 (:func:`quantize_q4`): ``inference_model(model, "q4")``."""

    weights_format = "q4"

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, batched: bool) -> None:
        super().__init__(quantize_q4(weight), bias, batched)
