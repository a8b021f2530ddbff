"""Tensors in the memory layouts models hand them over in: the same values as transposed, sliced,
expanded and channels-last views, for the tests that no backend depends on strides.

Notation: ``B`` batch, ``H`` query heads, ``T`` query length, ``D`` head dim.

A layout is a name from :data:`LAYOUTS` and a dim (read only by ``"expanded"``). Every layout but
``"expanded"`` keeps the values; ``"expanded"`` repeats the first slice along its dim, so a test
takes the values from :func:`relaid` first and lays them out again: relaying those values with the
same layout keeps them.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import Tensor

from dikkat.core import attention
from helpers import Case, Result

LAYOUTS = (
    "contiguous",
    "transposed",  # the last two dims swapped in memory: the last dim strided (k for q·kᵀ)
    "column_major",  # every dim's order reversed in memory
    "channels_last",  # (B, H, T, D) stored (B, T, D, H), as torch.channels_last stores (N, C, H, W)
    "every_other",  # every other slot of a last dim twice as long: stride 2
    "narrowed",  # a slice of a longer last dim, as q, k, v cut from one fused projection
    "expanded",  # stride 0 along a dim: one slice repeated, as the gradient of a .sum()
)

Layout = tuple[str, int]  # (name, dim)
CONTIGUOUS: dict[str, Layout] = dict.fromkeys(("q", "k", "v", "bias", "dout"), ("contiguous", 0))


def _noise(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """What lies between a strided view's elements: values that change the result if read."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(like)


def relaid(x: Tensor, layout: str, dim: int = 0) -> Tensor:
    """x's values (repeated along ``dim`` for ``"expanded"``) in the memory layout ``layout``:
    a tensor of x's shape, dtype and device with other strides."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout in ("transposed", "column_major") or (layout == "channels_last" and x.dim() != 4):
        dims = tuple(reversed(range(x.dim())))
        return x.permute(dims).contiguous().permute(dims)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout in ("every_other", "narrowed"):
        n = x.shape[-1]
        wide = _noise((*x.shape[:-1], 2 * n if layout == "every_other" else n + 3), x)
        view = wide[..., ::2] if layout == "every_other" else wide[..., 1 : n + 1]
        view.copy_(x)
        return view
    if layout == "expanded":
        d = dim % x.dim()
        return x.narrow(d, 0, 1).expand_as(x)
    raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


def layouts(*names: str) -> st.SearchStrategy[dict[str, Layout]]:
    """A layout for each named tensor, drawn independently."""
    one = st.tuples(st.sampled_from(LAYOUTS), st.integers(0, 3))
    return st.fixed_dictionaries(dict.fromkeys(names, one))


def values(inputs: dict[str, Tensor | None], lay: dict[str, Layout]) -> dict[str, Tensor | None]:
    """The inputs with the values their layouts give them (``"expanded"`` repeats a slice),
    contiguous: what the oracle sees."""
    return {n: None if t is None else relaid(t, *lay[n]).contiguous() for n, t in inputs.items()}


def run_relaid(
    case: Case,
    inputs: dict[str, Tensor | None],
    dtype: torch.dtype,
    backend: str,
    lay: dict[str, Layout],
    *,
    bias_grad: bool = False,
    device: str = "cpu",
) -> tuple[Result, Tensor | None]:
    """``helpers.run`` with q, k, v, the bias and the output's gradient ``dout`` in ``dtype``
    laid out as ``lay`` says (each a leaf of autograd in that layout), and the bias's gradient
    (None without a bias or ``bias_grad``). ``inputs`` should come from :func:`values`."""
    x = {
        n: None if t is None else relaid(t.to(device=device, dtype=dtype), *lay[n]).detach()
        for n, t in inputs.items()
    }
    q, k, v = (x[n].requires_grad_() for n in "qkv")
    bias = x["bias"]
    wrt = [q, k, v]
    if bias is not None and bias_grad:
        wrt.append(bias.requires_grad_())
    out = attention(q, k, v, case.mask, bias=bias, q_offset=case.q_offset, backend=backend)
    grads = torch.autograd.grad(out, wrt, x["dout"])
    return Result(out.detach(), *grads[:3]), (grads[3] if len(grads) == 4 else None)
