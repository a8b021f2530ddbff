"""The position-wise MLP of a Transformer block: d → hidden (usually 4d) → d."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from dikkat.layers.linear import Linear

Activation = Literal["gelu", "gelu_tanh", "relu"]

_ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),  # exact, with erf: BERT
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # GPT-2's tanh approximation
    "relu": lambda: nn.ReLU(),  # the original 2017 Transformer
}


class MLP(nn.Module):
    """x (B, T, C) → down(act(up(x))) (B, T, C); the hidden width defaults to 4·C.

    Dropout, where wanted, belongs to the residual branch around it (see :class:`Block`).
    """

    def __init__(
        self,
        d_model: int,
        hidden: int | None = None,
        *,
        activation: Activation = "gelu",
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        hidden = 4 * d_model if hidden is None else hidden
        self.up = Linear(d_model, hidden, bias=bias)
        self.act = _ACTIVATIONS[activation]()
        self.down = Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))
