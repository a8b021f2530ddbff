"""A frozen layer's product that a gradient flows back through: what training adapters on a
model whose base weights stay as its file holds them needs (QLoRA, Dettmers et al. 2023,
"QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314: the frozen 4-bit weight is
dequantised in the backward pass too, never kept in full precision).

``frozen_linear(x, layer)`` is ``layer(x)`` forward — the packed blocks' own product, exactly —
and, backward, the input's gradient ``∂L/∂x = ∂L/∂y · W`` with W the layer's dequantised weight
(the rounding of x to int16 per block of 32 in the forward is taken as the identity: a
straight-through estimate, as QLoRA takes its own rounding). W is dequantised a block of
:data:`ROWS_AT_ONCE` rows at a time and let go, so a backward holds at most one block of it in
fp32, never the layer's whole weight. The layer's own weights get no gradient.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.weights.half import HalfLinear
from dikkat.weights.packed import dequantize
from dikkat.weights.packed_layers import PackedLinear

__all__ = ["ROWS_AT_ONCE", "frozen_linear", "half_backward", "input_gradient"]

ROWS_AT_ONCE = 2048  # weight rows dequantised at once in a backward pass


def frozen_linear(x: Tensor, layer: nn.Module) -> Tensor:
    """``layer(x)``, differentiable in ``x`` (see the module doc); ``layer`` is a
    :class:`~dikkat.weights.packed_layers.PackedLinear`, a
    :class:`~dikkat.weights.half.HalfLinear` (a 16-bit table, widened a block of rows at a time
    alike) or an ``nn.Linear`` whose weight is frozen (``requires_grad`` False)."""
    if not isinstance(layer, (PackedLinear, HalfLinear, nn.Linear)):
        raise TypeError(
            f"layer must be a PackedLinear, HalfLinear or nn.Linear, got {type(layer).__name__}"
        )
    if isinstance(layer, nn.Linear) and layer.weight.requires_grad:
        raise ValueError("layer's weight requires grad: freeze it (requires_grad_(False)) first")
    if (
        not isinstance(x, Tensor)
        or not x.is_floating_point()
        or x.shape[-1:] != (layer.in_features,)
    ):
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be floating-point (..., {layer.in_features}), got {got}")
    return _FrozenProduct.apply(x, layer)


class _FrozenProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: nn.Module) -> Tensor:  # type: ignore[override]
        ctx.layer, ctx.dtype, ctx.half = layer, x.dtype, half_backward()
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return input_gradient(grad, ctx.layer, half=ctx.half).to(ctx.dtype), None


def half_backward() -> bool:
    """Whether a frozen product's backward runs in bf16: under bf16 autocast on the CPU (the
    forward's state, recorded for its backward), as autocast's own products do."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def input_gradient(grad: Tensor, layer: nn.Module, *, half: bool = False) -> Tensor:
    """``grad · W`` (..., K) for the output gradient ``grad`` (..., N) of ``layer``'s product,
    W (N, K) its weight dequantised a block of rows at a time; in fp32, or with ``half`` each
    block's product in bf16 (summed in fp32), which CPUs with AVX512-BF16 or AMX run at twice
    fp32's pace or more."""
    dtype = torch.bfloat16 if half else torch.float32
    g = grad.reshape(-1, grad.shape[-1]).to(dtype)
    out: Tensor | None = None
    for start, w in _weight_blocks(layer, dtype):
        product = g[:, start : start + w.shape[0]] @ w
        out = product.float() if out is None else out.add_(product)
    assert out is not None
    return out.view(*grad.shape[:-1], out.shape[-1])


def _weight_blocks(layer: nn.Module, dtype: torch.dtype) -> Iterator[tuple[int, Tensor]]:
    """(first row, rows of W in ``dtype``): the whole weight of an ``nn.Linear``, else blocks of
    at most :data:`ROWS_AT_ONCE` rows of each part, dequantised (or widened) as they are needed."""
    if isinstance(layer, nn.Linear):
        yield 0, layer.weight.detach().to(dtype)
        return
    start = 0  # the part's first row in the layer's output
    for part in layer.parts:
        rows = part.shape[0]
        for a in range(0, rows, ROWS_AT_ONCE):
            b = min(a + ROWS_AT_ONCE, rows)
            w = part[a:b] if isinstance(part, Tensor) else dequantize(part.rows(a, b), dtype)
            yield start + a, w.to(dtype)
        start += rows
