"""Whether this call is being traced (torch.compile, torch.export, TorchScript tracing) or runs
under a torch.func transform (vmap, grad, jacrev): where a tensor's values cannot reach Python.

Inside such a region dikkat's checks that read values on the host — a non-finite input, a mask
tensor's contents — cannot run (dynamo would break the graph on them; vmap refuses ``.item()``
outright). :mod:`dikkat.core.nonfinite` then keeps its rule without host reads, and the tiled
backend plans from shapes alone.
"""

from __future__ import annotations

import torch


def tracing() -> bool:
    """True inside ``torch.compile``/``torch.export`` tracing, ``torch.jit.trace``, or a
    ``torch.func`` transform (vmap, grad, jvp, jacrev, functionalize) at this point."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    return torch._C._functorch.peek_interpreter_stack() is not None
