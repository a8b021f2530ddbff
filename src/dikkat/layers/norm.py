"""LayerNorm over the feature axis: mean 0, variance 1, then a learned scale and shift.

It stops the scale of x from drifting from layer to layer (the seed, S10).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LayerNorm(nn.Module):
    """y = (x − mean(x)) / √(var(x) + eps) · weight + bias, statistics over the last axis.

    ``var`` is the biased (1/C) variance, as in ``torch.nn.LayerNorm``, whose fused kernel
    (``F.layer_norm``) computes it; ``bias=False`` drops the shift.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        if d_model <= 0:
            raise ValueError(f"d_model must be positive, got {d_model}")
        self.d_model, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"LayerNorm expects a last dim of {self.d_model}, got x of shape {tuple(x.shape)}"
            )
        return F.layer_norm(x, (self.d_model,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, bias={self.bias is not None}"
