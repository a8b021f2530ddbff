"""``triton_attention``: the block plan, the forward kernel and the backward kernels as one
autograd function.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dikkat.core.checks import broadcast_kv, check_mask, check_qkv, check_scale
from dikkat.core.masks import Mask
from dikkat.core.triton.blocks import BlockPlan, block_plans
from dikkat.core.triton.launch import Launch, choose_blocks
from dikkat.core.triton.support import interpreting, unsupported

__all__ = ["TritonAttention", "triton_attention"]


class TritonAttention(torch.autograd.Function):
    """``(out, lse)`` of a planned call; differentiable in q, k and v (lse is not)."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, plan: BlockPlan,
        launch: Launch,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        # imported here, not at the top: triton is an optional dependency (the gpu extra)
        from dikkat.core.triton.kernels_fwd import forward

        out, lse = forward(q, k, v, bias, plan, launch)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (bias, plan, launch)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        from dikkat.core.triton.kernels_bwd import backward  # optional dependency, as above

        q, k, v, out, lse = ctx.saved_tensors
        bias, plan, launch = ctx.args
        dq, dk, dv = backward(q, k, v, out, lse, dout.contiguous(), bias, plan, launch)
        return dq, dk, dv, None, None, None


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    scale: float | None = None,
    bias: Tensor | None = None,
    q_offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """Exact attention in Triton kernels: ``(out (B, H, T, Dv), lse (B, H, T) fp32)``,
    differentiable in q, k and v.

    Args:
        q, k, v, mask, scale, bias, q_offset: as in :func:`dikkat.attention` (k, v of batch
            size B or 1; ``mask`` a dikkat mask or a bool tensor broadcastable to (B, H, T, S)).
            The bias may not need a gradient.

    Raises ``ValueError`` for what the kernels cannot run (:func:`~dikkat.core.triton.support.
    unsupported` gives the reason): triton missing, tensors off CUDA (unless triton's
    interpreter is on), a dtype other than fp16/bf16/fp32, head dims outside 16 … 256, a bias
    that needs a gradient.
    """
    shape = check_qkv(q, k, v)
    scale = check_scale(scale, shape.D)
    mask = check_mask(mask, shape, q_offset)
    reason = unsupported(q, bias)
    if reason is not None:
        raise ValueError(f"triton_attention cannot run this call: {reason}")
    B, H, T, S = shape.B, shape.H, shape.T, shape.S
    k, v = broadcast_kv(k, B), broadcast_kv(v, B)
    if bias is not None:  # viewed as (B|1, H|1, T|1, S|1)
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    block_m, block_n = choose_blocks(shape.D, shape.Dv, interpreting())
    plan = block_plans.get(mask, (B, H, T, S), q_offset, block_m, block_n, q.device)
    launch = Launch(scale, q_offset, shape.D, shape.Dv, q.dtype)
    return TritonAttention.apply(q, k, v, bias, plan, launch)
