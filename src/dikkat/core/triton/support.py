"""Whether the Triton kernels can run a call, and if not, why: checked without importing triton.

Notation: ``B`` batch, ``H`` query heads, ``T``/``S`` query/key length, ``D``/``Dv`` head dims.

The kernels run on CUDA tensors. With ``TRITON_INTERPRET=1`` set before triton is first
imported, triton's interpreter runs them instead, on CPU tensors, as numpy — slowly, for tests
(https://triton-lang.org/main/programming-guide/chapter-3/debugging.html). Which of the two the
kernels are is fixed when their module is first imported, so one process runs them one way.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch
from torch import Tensor

from dikkat.core.tracing import tracing

__all__ = ["installed", "interpreting", "unsupported"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
_KERNELS = "dikkat.core.triton.kernels_fwd"


@functools.cache
def installed() -> bool:
    """Whether triton can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is on now."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _interpreted(module: str, name: str) -> bool | None:
    """Whether a jit function of an imported module was built for the interpreter (None: the
    module is not imported)."""
    loaded = sys.modules.get(module)
    if loaded is None:
        return None
    return type(getattr(loaded, name)).__name__ == "InterpretedFunction"


def _mode_mismatch() -> str | None:
    """Why the kernels as built cannot run as ``TRITON_INTERPRET`` now asks, or None."""
    on = interpreting()
    ours = _interpreted(_KERNELS, "allowed_pairs")
    if ours is not None and ours != on:
        built = "triton's interpreter" if ours else "the GPU"
        return (
            f"its kernels were built for {built}, but TRITON_INTERPRET is now "
            f"{'on' if on else 'off'} (one process runs them one way)"
        )
    if on and _interpreted("triton.language.standard", "zeros") is False:
        return (
            "triton was imported before TRITON_INTERPRET was set, so its own functions are "
            "built for the GPU: set it before anything imports triton"
        )
    return None


def unsupported(
    q: Tensor, bias: Tensor | None, D: int | None = None, Dv: int | None = None
) -> str | None:
    """Why the kernels cannot run a call with these queries (B, H, T, D) and bias, or None."""
    if tracing():  # asked first: installed() is a functools.cache dynamo would trace through
        return (
            "inside torch.compile, torch.export or a torch.func transform dikkat's Triton "
            "launches are not traced (untested there): sdpa, flex or tiled serve the call"
        )
    if not installed():
        return "triton is not installed (pip install 'dikkat[gpu]')"
    mismatch = _mode_mismatch()
    if mismatch is not None:
        return mismatch
    if interpreting():
        if q.device.type != "cpu":
            return (
                f"triton's interpreter is on (TRITON_INTERPRET=1): it runs CPU tensors, got "
                f"{q.device.type}"
            )
        if q.dtype != torch.float32:
            return f"triton's interpreter has no {q.dtype} arithmetic: it runs float32 only"
    elif q.device.type != "cuda":
        return (
            f"its kernels run on CUDA tensors, got {q.device.type} (TRITON_INTERPRET=1, set "
            "before triton is imported, runs them on CPU in triton's interpreter, for tests)"
        )
    if q.dtype not in DTYPES:
        return f"it runs float16, bfloat16 and float32, got {q.dtype}"
    D = q.shape[-1] if D is None else D
    for name, d in (("head dim", D), ("value head dim", D if Dv is None else Dv)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            return f"its {name} must be {MIN_HEAD_DIM} … {MAX_HEAD_DIM}, got {d}"
    if bias is not None and bias.requires_grad:
        return "it gives no gradient for the bias (the tiled backend does)"
    return None
