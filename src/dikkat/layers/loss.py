"""Cross-entropy over a large vocabulary without holding the (N, V) logits.

A language model's last step, ``logits = x @ Wᵀ`` followed by ``cross_entropy(logits, y)``, is
the widest tensor of a training step: for GPT-2 (V = 50257) and 1,024 tokens, 206 MB of fp32
logits, the same again for their log-softmax, and again for its gradient. Memory traffic and
fresh pages for those buffers cost more than the softmax arithmetic itself.

:func:`linear_cross_entropy` walks the rows in chunks instead. For each chunk it computes the
logits, the log-sum-exp and the loss, and — since the loss is a scalar whose gradient is known
the moment the chunk's softmax is — the gradient ``dlogits = (softmax − onehot) / n`` right away,
turned at once into the chunk's share of ``dx = dlogits @ W`` and ``dW += dlogitsᵀ @ x``. The
chunk's logits are then dropped; backward only scales the saved ``dx`` and ``dW`` by the incoming
gradient. The arithmetic is the same three matrix products as the plain path.

Notation: N rows (tokens), C width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# rows per chunk: 1024 × 50257 fp32 logits = 206 MB live at a time. Smaller chunks hold less,
# but the weight gradient's products get thin (1024 → 256 rows: 8 % slower here, fp32 and bf16)
DEFAULT_CHUNK = 1024


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = DEFAULT_CHUNK,
) -> Tensor:
    """Mean of ``cross_entropy(x @ weight.T, targets)`` over rows whose target ≠ ``ignore_index``.

    Args:
        x: (N, C) hidden states (any leading dims are flattened).
        weight: (V, C) output projection (a tied embedding is fine: its gradient adds up).
        targets: (N,) class ids, or ``ignore_index`` for rows without a loss.
        chunk_size: rows per chunk; a chunk's (chunk, V) logits are the largest temporary.

    Equal to the plain formula (tested in fp64); under CPU bf16 autocast the products run in
    bf16 and the softmax in fp32, as autocast would do. No rows to score gives 0.
    """
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor):
        raise TypeError("x and weight must be tensors")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be (V, C) with C = x's last dim; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    x2 = x.reshape(-1, x.shape[-1])
    if targets.dtype.is_floating_point or targets.numel() != x2.shape[0]:
        raise ValueError(
            f"targets must hold one integer id per row of x; got targets "
            f"{tuple(targets.shape)} ({targets.dtype}) for x {tuple(x.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    return _LinearCrossEntropy.apply(
        x2, weight, targets.reshape(-1), ignore_index, chunk_size, dtype
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        targets: Tensor,
        ignore_index: int,
        chunk_size: int,
        dtype: torch.dtype | None,
    ) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            compute = dtype or torch.promote_types(x.dtype, weight.dtype)
            xc, w = x.to(compute), weight.to(compute)  # cast once, not once per chunk
            valid = targets != ignore_index
            n = int(valid.sum())
            safe = targets.masked_fill(~valid, 0)
            acc = torch.promote_types(compute, torch.float32)  # softmax and sums in ≥ fp32
            need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            dx = torch.empty_like(xc) if need_x else None
            dw = torch.zeros(weight.shape, dtype=acc) if need_w else None
            total = torch.zeros((), dtype=acc)
            for s in range(0, xc.shape[0], chunk_size):
                rows = slice(s, s + chunk_size)
                logits = (xc[rows] @ w.t()).to(acc)  # (n_chunk, V)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, safe[rows, None]).squeeze(1)
                keep = valid[rows]
                total += ((lse - picked) * keep).sum()
                if dx is None and dw is None:
                    continue
                grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                grad.scatter_add_(1, safe[rows, None], -keep[:, None].to(acc))  # − onehot
                grad.mul_(keep.to(acc)[:, None] / max(n, 1))  # mean; ignored rows → 0
                grad = grad.to(compute)
                if dx is not None:
                    torch.mm(grad, w, out=dx[rows])
                if dw is not None:
                    if compute == acc:
                        dw.addmm_(grad.t(), xc[rows])
                    else:  # bf16 product, fp32 sum across chunks
                        dw += grad.t() @ xc[rows]
        ctx.save_for_backward(
            *(t if t is not None else torch.empty(0) for t in (dx, dw)),
        )
        ctx.has = (dx is not None, dw is not None)
        ctx.dtypes = (x.dtype, weight.dtype)
        return total / max(n, 1)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        dx, dw = ctx.saved_tensors
        has_x, has_w = ctx.has
        one = bool(grad_out == 1)  # the usual case: hand the saved gradients over as they are
        gx = (dx if one else dx * grad_out).to(ctx.dtypes[0]) if has_x else None
        gw = (dw if one else dw * grad_out).to(ctx.dtypes[1]) if has_w else None
        return gx, gw, None, None, None, None
