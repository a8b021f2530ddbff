"""Exact attention in Triton kernels (FlashAttention-2), with dikkat's masks as block skipping.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (G divides H), ``T``/``S``
query/key length, ``D``/``Dv`` head dims, ``BM``/``BN`` query/key rows per block.

- :mod:`~dikkat.core.triton.blocks` — on the host, which key blocks each query block visits: the
  mask's ``kv_range`` skips blocks (never loaded), ``kv_full_range`` runs blocks unmasked, and
  the partial blocks are masked elementwise, in the kernel for causal and sliding-window bands,
  else from a bool tile the mask's predicate fills for those blocks alone.
- :mod:`~dikkat.core.triton.kernels_fwd` — the online softmax over those blocks, saving the
  log-sum-exp; :mod:`~dikkat.core.triton.kernels_bwd` — dK/dV and dQ recomputed from it.
- :mod:`~dikkat.core.triton.autograd` — :func:`triton_attention`, the two as one autograd
  function; :mod:`~dikkat.core.triton.support` — what the kernels can run, and why not.
- :mod:`~dikkat.core.triton.decode` — :func:`triton_decode`, a few queries over a long cache
  with the keys split across programs and merged by lse (flash-decoding); the backend routes
  decoding steps there.

Triton is an optional dependency (``pip install 'dikkat[gpu]'``): nothing here imports it until a
kernel runs, so ``import dikkat`` works without it. With ``TRITON_INTERPRET=1`` set before triton
is imported, triton's interpreter runs the kernels on CPU tensors (float32), which is how the
tests run them on machines without a GPU.

What differs from the reference: the sum runs in another order (results differ by rounding); the
matmuls run in the input dtype (fp32 inputs in full fp32, not TF32) and the softmax statistics
and accumulators in fp32; the weights are rounded to the input dtype before P·V. No dropout, no
soft-capping, no weights, no gradient for the bias. Rows with every key masked give output 0 and
``lse = −inf``.
"""

from dikkat.core.triton.autograd import triton_attention
from dikkat.core.triton.blocks import BlockPlanCache, block_plans
from dikkat.core.triton.decode import triton_decode
from dikkat.core.triton.support import installed, interpreting, unsupported

__all__ = [
    "BlockPlanCache",
    "block_plans",
    "installed",
    "interpreting",
    "triton_attention",
    "triton_decode",
    "unsupported",
]
