"""The position-wise MLP of a Transformer block: d → hidden (usually 4d) → d; and the gated MLP
of Llama-family and Gemma models, where a second projection gates the first."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from dikkat.layers.inputs import check_meets
from dikkat.layers.linear import Linear, LinearRows
from dikkat.validate import check_bool, check_choice, check_int

Activation = Literal["gelu", "gelu_tanh", "relu"]

_ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),  # exact, with erf: BERT
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # GPT-2's tanh approximation
    "relu": lambda: nn.ReLU(),  # the original 2017 Transformer
}
ACTIVATIONS = tuple(_ACTIVATIONS)  # the names configs may give

GateActivation = Literal["silu", "gelu_tanh"]
_GATE_ACTIVATIONS = {
    "silu": lambda: nn.SiLU(),  # SwiGLU: Llama, Mistral, Qwen2, SmolLM
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # GeGLU with the tanh GELU: Gemma
}
GATE_ACTIVATIONS = tuple(_GATE_ACTIVATIONS)


def gate_activation(name: GateActivation) -> nn.Module:
    """The activation a gated MLP applies to its gate, by name (one of GATE_ACTIVATIONS)."""
    check_choice("activation", name, GATE_ACTIVATIONS)
    return _GATE_ACTIVATIONS[name]()


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
        check_int("d_model", d_model)
        check_int("hidden", hidden, optional=True)
        check_choice("activation", activation, ACTIVATIONS)
        check_bool("bias", bias)
        hidden = 4 * d_model if hidden is None else hidden
        self.up = Linear(d_model, hidden, bias=bias)
        self.act = _ACTIVATIONS[activation]()
        self.down = Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        check_meets("x", x, self.up.weight, "MLP")
        return self.down(self.act(self.up(x)))


class GatedMLP(nn.Module):
    """x (B, T, C) → down(act(gate(x)) ∘ up(x)) (B, T, C): a gated linear unit (Shazeer 2020,
    "GLU Variants Improve Transformer", arXiv:2002.05202) — SwiGLU with ``silu``, GeGLU with
    ``gelu_tanh``. No biases, as in every family that uses it.

    ``gate_up``: None, or a layer holding gate's and up's weights stacked by rows (gate, then
    up), which then multiplies x once for both; a loader that keeps a file's weights packed sets
    it, with ``gate`` and ``up`` views of its rows (:class:`~dikkat.layers.linear.LinearRows`).

    >>> import torch
    >>> GatedMLP(16, 40)(torch.randn(2, 3, 16)).shape
    torch.Size([2, 3, 16])
    """

    def __init__(self, d_model: int, hidden: int, *, activation: GateActivation = "silu") -> None:
        super().__init__()
        check_int("d_model", d_model)
        check_int("hidden", hidden)
        check_choice("activation", activation, GATE_ACTIVATIONS)
        self.gate = Linear(d_model, hidden, bias=False)
        self.up = Linear(d_model, hidden, bias=False)
        self.act = _GATE_ACTIVATIONS[activation]()
        self.down = Linear(hidden, d_model, bias=False)
        self.gate_up: nn.Module | None = None

    def forward(self, x: Tensor) -> Tensor:
        check_meets("x", x, self.up.weight, "GatedMLP")
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        h = self.act(gate)
        if torch.is_grad_enabled() and (h.requires_grad or up.requires_grad):
            return self.down(h * up)
        return self.down(h.mul_(up))  # into act's fresh output: one prompt-sized buffer less

    def hold_gate_up(self, layer: nn.Module) -> None:
        """Make ``layer`` (gate's rows, then up's: e.g. a packed layer a loader built from a
        file's blocks) ``gate_up``, which multiplies x once for both, with ``gate`` and ``up``
        views of its rows."""
        hidden = self.up.out_features
        shape = (getattr(layer, "out_features", None), getattr(layer, "in_features", None))
        if shape != (2 * hidden, self.up.in_features):
            raise ValueError(
                f"the gate/up layer must be ({2 * hidden}, {self.up.in_features}), got {shape}"
            )
        self.gate_up = layer
        self.gate = LinearRows(layer, 0, hidden)  # type: ignore[assignment,arg-type]
        self.up = LinearRows(layer, hidden, 2 * hidden)  # type: ignore[assignment,arg-type]
