"""Normalisation over the feature axis, which stops the scale of x from drifting from layer to
layer (docs/contract.md §10): LayerNorm (mean 0, variance 1, then a learned scale and shift) and
RMSNorm (root mean square 1, then a learned scale; Zhang & Sennrich 2019, arXiv:1910.07467), the
norm of Llama, Mistral, Qwen and Gemma.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.layers.inputs import check_meets
from dikkat.validate import check_bool, check_float, check_int


class LayerNorm(nn.Module):
    """y = (x − mean(x)) / √(var(x) + eps) · weight + bias, statistics over the last axis.

    ``var`` is the biased (1/C) variance, as in ``torch.nn.LayerNorm``, whose fused kernel
    (``F.layer_norm``) computes it; ``bias=False`` drops the shift.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        check_int("d_model", d_model)
        # eps ≤ 0 divides by zero on a constant row; a negative one makes √(var + eps) NaN
        check_float("eps", eps, low=0.0, low_open=True)
        check_bool("bias", bias)
        self.d_model, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        check_meets("x", x, self.weight, "LayerNorm", mixed=True)
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"LayerNorm expects a last dim of {self.d_model}, got x of shape {tuple(x.shape)}"
            )
        return F.layer_norm(x, (self.d_model,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """y = x / √(mean(x²) + eps) · weight, over the last axis; no mean is subtracted, no shift.

    The statistics and the product run in fp32 (fp64 for fp64 inputs) and the result is cast
    back to x's dtype, as Llama's and Gemma's reference implementations do. Gemma writes its scale
    as ``1 + w``; a loader adds the 1 once (``weight = 1 + w``), so the math here is the same for
    every family.
    It also normalises per head: ``RMSNorm(D)`` on q (B, H, T, D) is Gemma 3's and Qwen 3's
    query/key norm.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        check_int("d_model", d_model)
        check_float("eps", eps, low=0.0, low_open=True)  # eps ≤ 0: a zero row divides by zero
        self.d_model, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"RMSNorm expects a last dim of {self.d_model}, got x of shape {tuple(x.shape)}"
            )
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, (self.d_model,), self.weight, self.eps)  # one fused kernel
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        h = x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.to(wide)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"
