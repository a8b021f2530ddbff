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

from dikkat.layers.inputs import check_token_ids
from dikkat.validate import check_int

# rows per chunk: 1024 × 50257 fp32 logits = 206 MB live at a time. Smaller chunks hold less,
# but the weight gradient's products get thin (1024 → 256 rows: 8 % slower here, fp32 and bf16)
DEFAULT_CHUNK = 1024


class Scratch:
    """Buffers that one caller (a model's loss) keeps between calls.

    A training step of GPT-2 small asks for the same four temporaries of 0.1–0.2 GB each (the
    cast weight, the chunk's logits, their log-softmax, its bf16 gradient) every step. Fresh ones
    come from the operating system as zero-filled pages, one fault per 4 KiB, which can make a
    cast cost several times the copy itself (BENCHMARKS.md, Training). Reused buffers cost the
    copy only. The price is that memory stays held between calls; not for concurrent use.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
        """An uninitialised (``shape``, ``dtype``) buffer, the same one as last time if it fits."""
        t = self._buffers.get(name)
        if t is None or t.shape != shape or t.dtype != dtype or t.device != torch.device(device):
            t = self._buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return t

    def clear(self) -> None:
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        """The memory the buffers hold now."""
        return sum(t.nbytes for t in self._buffers.values())

    def __getstate__(self) -> dict:
        # pickling or copying a model (torch.save(model), copy.deepcopy) carries no buffers
        return {"_buffers": {}}


def _fresh(name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = DEFAULT_CHUNK,
    scratch: Scratch | None = None,
) -> Tensor:
    """Mean of ``cross_entropy(x @ weight.T, targets)`` over rows whose target ≠ ``ignore_index``.

    Args:
        x: (N, C) hidden states (any leading dims are flattened).
        weight: (V, C) output projection (a tied embedding is fine: its gradient adds up).
        targets: (N,) class ids, or ``ignore_index`` for rows without a loss.
        chunk_size: rows per chunk; a chunk's (chunk, V) logits are the largest temporary.
        scratch: where to keep the large temporaries between calls (a training loop calls with
            the same shapes every step); None allocates them afresh each call.

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
    check_int("ignore_index", ignore_index, at_least=None)
    # an id past the vocabulary would make gather/scatter fail with an index error
    check_token_ids("targets", targets, weight.shape[0], layout=None, ignore_index=ignore_index)
    if targets.numel() != x2.shape[0]:
        raise ValueError(
            f"targets must hold one integer id per row of x; got targets "
            f"{tuple(targets.shape)} ({targets.dtype}) for x {tuple(x.shape)}"
        )
    check_int("chunk_size", chunk_size)
    if scratch is not None and not isinstance(scratch, Scratch):
        raise TypeError(f"scratch must be a Scratch or None, got {type(scratch).__name__}")
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    buffer = _fresh if scratch is None else scratch.get
    return _LinearCrossEntropy.apply(
        x2, weight, targets.reshape(-1).long(), ignore_index, chunk_size, dtype, buffer
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
        buffer: Any,
    ) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            compute = dtype or torch.promote_types(x.dtype, weight.dtype)
            acc = torch.promote_types(compute, torch.float32)  # softmax and sums in ≥ fp32
            dev = x.device
            N, V = x.shape[0], weight.shape[0]
            xc = x.to(compute)
            w = weight  # cast once, not once per chunk
            if w.dtype != compute:
                w = buffer("weight", tuple(w.shape), compute, dev).copy_(w)
            valid = targets != ignore_index
            n = int(valid.sum())
            safe = targets.masked_fill(~valid, 0)
            need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            dx = torch.empty_like(xc) if need_x else None
            dw: Tensor | None = None
            total = torch.zeros((), dtype=acc, device=dev)
            rows_max = min(chunk_size, N)
            for s in range(0, N, chunk_size):
                rows = slice(s, s + chunk_size)
                r = min(N, s + chunk_size) - s
                logits = torch.mm(
                    xc[rows], w.t(), out=buffer("logits", (rows_max, V), compute, dev)[:r]
                )
                logp = logits
                if compute != acc:
                    logp = buffer("logp", (rows_max, V), acc, dev)[:r].copy_(logits)
                # in place: PyTorch's row kernel reads each row whole before writing it
                torch.log_softmax(logp, 1, out=logp)
                picked = logp.gather(1, safe[rows, None]).squeeze(1)
                keep = valid[rows]
                total -= (picked * keep).sum()
                if dx is None and not need_w:
                    continue
                p = logp.exp_()  # the softmax
                p.scatter_add_(1, safe[rows, None], -keep[:, None].to(acc))  # − onehot
                scale = (keep.to(acc) / max(n, 1))[:, None]  # mean; ignored rows → 0
                if compute == acc:
                    grad = p.mul_(scale)
                else:  # scaled and rounded to the product dtype in one pass
                    grad = torch.mul(p, scale, out=buffer("grad", (rows_max, V), compute, dev)[:r])
                if dx is not None:
                    torch.mm(grad, w, out=dx[rows])
                if need_w:
                    if dw is None:
                        dw = (grad.t() @ xc[rows]).to(acc)
                    elif compute == acc:
                        dw.addmm_(grad.t(), xc[rows])
                    else:  # bf16 product, fp32 sum across chunks
                        dw += torch.mm(
                            grad.t(), xc[rows], out=buffer("dw_part", tuple(w.shape), compute, dev)
                        )
            if need_w and dw is None:  # no rows at all
                dw = torch.zeros(weight.shape, dtype=acc, device=dev)
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
        return gx, gw, None, None, None, None, None
