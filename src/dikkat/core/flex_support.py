"""What the flex backend accepts: the calls torch's FlexAttention can serve, eagerly and inside
a trace (torch.compile, torch.export, torch.func transforms, torch.jit.trace)."""

from __future__ import annotations

import torch
from torch import Tensor

from dikkat.core.flex_masks import flex_module
from dikkat.core.tracing import tracing

__all__ = ["flex_supports", "needs_grad", "traced_refusal"]

_DEVICES = ("cuda", "cpu", "xpu", "hpu", "mps")


def needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def flex_supports(
    q: Tensor,
    *,
    dropout: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    k: Tensor | None = None,
    v: Tensor | None = None,
    bias: Tensor | None = None,
) -> str | None:
    """None when flex can serve a call like this, else the reason it cannot. ``k``, ``v`` and
    ``bias`` tell whether the call needs gradients, which matters inside a trace
    (:func:`traced_refusal`)."""
    if flex_module() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs ≥ 2.5)"
    if return_weights:
        return "it never holds the full weights (use return_lse and dikkat.attention_weights)"
    if dropout > 0:
        return "FlexAttention has no dropout"
    if q.device.type not in _DEVICES:
        return f"FlexAttention runs on {', '.join(_DEVICES)}, not {q.device.type}"
    if return_lse and q.device.type == "cpu":
        return f"compiled FlexAttention on CPU returns no log-sum-exp (torch {torch.__version__})"
    return traced_refusal(q, k, v, bias) if tracing() else None


def traced_refusal(
    q: Tensor, k: Tensor | None = None, v: Tensor | None = None, bias: Tensor | None = None
) -> str | None:
    """Inside ``torch.compile``/``torch.export`` or a ``torch.func`` transform, what torch's
    ``flex_attention`` cannot do there and dikkat's eager detours cannot reach: None when
    there is nothing. Outside those, the detours run (the tiled backward) and this is not asked."""
    if torch.jit.is_tracing():
        return "torch.jit.trace cannot record torch's flex_attention; use torch.export"
    # (dynamo reads the functorch stack as an object even when it is None: ask only outside it)
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack():
        return (
            f"torch's flex_attention has no rule for torch.func transforms (vmap, grad, jacrev) "
            f"in torch {torch.__version__}; backend='sdpa' (or 'reference', which soft-caps) runs "
            "under them"
        )
    if needs_grad(q, *(t for t in (k, v) if t is not None)) and q.device.type == "cpu":
        return (
            f"torch's flex_attention has no backward on CPU (torch {torch.__version__}), and "
            "inside torch.compile/torch.export dikkat cannot route it to the tiled backend as it "
            "does eagerly; use backend='tiled' (or call with no gradient needed)"
        )
    if bias is not None and needs_grad(bias):
        return (
            "a bias that needs a gradient takes dikkat's tiled backward, which cannot run inside "
            "torch.compile/torch.export; use backend='tiled'"
        )
    return None
