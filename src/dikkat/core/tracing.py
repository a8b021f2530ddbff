"""Whether this call is being traced (torch.compile, torch.export, TorchScript tracing) or runs
under a torch.func transform (vmap, grad, jacrev): where a tensor's values cannot reach Python.

Inside such a region dikkat's checks that read values on the host — a non-finite input, a mask
tensor's contents — cannot run (dynamo would break the graph on them; vmap refuses ``.item()``
outright). :mod:`dikkat.core.nonfinite` then keeps its rule without host reads, and the tiled
backend plans from shapes alone.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tracing() -> bool:
    """True inside ``torch.compile``/``torch.export`` tracing, ``torch.jit.trace``, or a
    ``torch.func`` transform (vmap, grad, jvp, jacrev, functionalize) at this point."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    return torch._C._functorch.peek_interpreter_stack() is not None


def plain(t: Tensor) -> Tensor:
    """The tensor beneath torch.func's wrappers (a vmapped one holds every batch entry)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def check_traced(ok: Tensor, message: str) -> None:
    """A check on tensor values where they cannot reach Python: ``ok`` (a 0-d bool computed
    from the inputs) must hold, else the call fails — a device-side assert inside a traced
    graph (``torch._assert_async``), a ``ValueError`` under a torch.func transform, whose
    wrappers the values are read beneath. Never a silently wrong answer."""
    if ok.device.type == "meta":
        return
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        torch._assert_async(ok, message)
    elif not bool(plain(ok.detach()).all()):
        raise ValueError(message)
