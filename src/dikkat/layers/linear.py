"""``Linear``: ``nn.Linear`` that can also multiply a block of its output features alone, and
:class:`LinearRows`, such a block used as a layer of its own.

:class:`LinearRows` is a block of a ``Linear``'s output features used on its own, e.g. the
queries of a fused q/k/v projection applied to x alone (cross-attention); it owns no parameters.

For inference, :func:`dikkat.weights.inference_model` copies a model with every ``Linear``
replaced by a layer that holds its weight packed for oneDNN or in a smaller format
(:mod:`dikkat.weights.inference`); a ``Linear`` itself always multiplies its own parameters.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.validate import check_bool, check_int


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict and math) plus :meth:`forward_rows`.

    >>> Linear(8, 4)(torch.randn(2, 8)).shape
    torch.Size([2, 4])
    """

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

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features [start, stop) alone: ``x @ W[start:stop]ᵀ + b[start:stop]``, the same
        numbers as those columns of ``forward(x)`` up to rounding."""
        bias = None if self.bias is None else self.bias[start:stop]
        return F.linear(x, self.weight[start:stop], bias)


class LinearRows(nn.Module):
    """Output features [start, stop) of a :class:`Linear` ``source``, used as a linear layer.

    Owns no parameters: ``weight`` and ``bias`` are views of the source's rows, so the state
    dict and the optimizer stay the source's (and in-place writes to ``weight`` under
    ``torch.no_grad()`` write the source). ``forward`` multiplies by those rows only, through
    the source's :meth:`~Linear.forward_rows`; in an inference copy
    (:func:`dikkat.weights.inference_model`) the source is the copy's inference layer, whose
    rows are held in its format.

    >>> qkv = Linear(8, 24)
    >>> k = LinearRows(qkv, 8, 16)
    >>> k.weight.shape, k(torch.randn(2, 8)).shape
    (torch.Size([8, 8]), torch.Size([2, 8]))
    """

    source: Linear

    def __init__(self, source: Linear, start: int, stop: int) -> None:
        super().__init__()
        # a dikkat Linear, or an inference copy's layer (which multiplies its rows alike)
        if not isinstance(source, nn.Module) or not hasattr(source, "forward_rows"):
            raise TypeError(
                f"source must be a dikkat Linear or an inference layer, got {type(source).__name__}"
            )
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
        w = self.source.weight
        if not isinstance(w, Tensor):  # an inference copy's layer shows a HeldWeight
            return dataclasses.replace(w, shape=torch.Size((self.out_features, w.shape[1])))
        return w[self.start : self.stop]  # (out_features, in_features)

    @property
    def bias(self) -> Tensor | None:
        b = self.source.bias
        return None if b is None else b[self.start : self.stop]

    def forward(self, x: Tensor) -> Tensor:
        return self.source.forward_rows(x, self.start, self.stop)

    def extra_repr(self) -> str:
        s = self.source
        of = f"{type(s).__name__}({s.in_features}, {s.out_features})"
        return f"rows {self.start}:{self.stop} of {of}"
