"""The tiled backend inside a traced region: two custom ops that run the eager path whole.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims, ``N`` the size of a vmapped dim.

The eager tiled path plans from the mask's values (``kv_range``, which tiles a mask hides), keeps
plans in a process-wide cache and writes its tiles into buffers: torch.compile would break its
graph at every host read, and ``torch.func.vmap`` refuses them outright. Under
:func:`dikkat.core.tracing.tracing` :func:`traced_tiled_attention` runs instead: the whole call
is one opaque ``torch.library.custom_op``, ``dikkat::tiled_forward``, whose implementation is the
eager forward (:func:`~dikkat.core.tiled.autograd.forward`, host reads and all), so a graph holds
one node for it and no break; its backward is a second op, ``dikkat::tiled_backward``, running
the eager backward (:func:`~dikkat.core.tiled.autograd.backward` and
:func:`~dikkat.core.tiled.sinks.sinks_grad`). Each op has a fake implementation (output shapes
and dtypes: ``out`` (B, H, T, Dv) in q's dtype, ``lse`` (B, H, T) in fp32, fp64 for fp64 q),
the backward op is the forward's autograd formula, and both have a vmap rule
(``torch.library.custom_op``'s ``register_fake``, ``register_autograd``, ``register_vmap``;
PyTorch's "Custom Python Operators" tutorial).

The mask travels as :func:`dikkat.core.mask_flat.flatten` gives it — a JSON description and its
tensors as op inputs — and is rebuilt inside each op. ``lse`` is not differentiable, as in
eager mode. The backward op returns a gradient for the bias and the sinks only when asked
(``bias_grad``, ``sinks_grad``); otherwise an empty tensor of shape (0,) in that place, which
the autograd formula drops: a custom op cannot return None inside its tuple. Double backward
is not supported (the backward op has no autograd formula of its own). The ``plans`` argument
of :func:`~dikkat.core.tiled.tiled_attention` has no effect here: the ops use the shared
:data:`~dikkat.core.tiled.cache.plans`.

vmap folds the vmapped dim into the batch: each input's vmapped dim is moved to the front (an
unvmapped input expanded to it) and (N, B) flattened to N·B rows; a bias, sinks or mask tensor
of batch size 1 is shared as it is, one of batch size B > 1 is repeated N times along dim 0
(the built-in masks index their tensors by batch). That holds for dikkat's own mask types
only; a mask of the caller's own may read the batch index any way, so its call runs once per
vmapped entry instead. A mask tensor that is itself vmapped is refused with a ValueError.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dikkat.core.checks import broadcast_kv, check_qkv, check_sinks
from dikkat.core.mask_flat import builtin_only, flatten, rebuild, tensor_names
from dikkat.core.masks import Mask
from dikkat.core.tiled.autograd import backward, forward, legacy_vmapped, per_entry
from dikkat.core.tiled.call import check_tiling, fused_choice, ready
from dikkat.core.tiled.kernel import acc_dtype, unit_last_stride
from dikkat.core.tiled.sinks import sinks_grad as sinks_gradient

__all__ = ["tiled_backward_op", "tiled_forward_op", "traced_tiled_attention"]


def traced_tiled_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, *, scale: float, softcap: float | None,
    bias: Tensor | None, q_offset: int, block: int | None, key_tile: int, cells: int,
    windows: bool | None, fused: bool | None, sinks: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`~dikkat.core.tiled.tiled_attention` (its arguments checked, ``softcap`` too) as
    one ``dikkat::tiled_forward`` op: no host reads outside it."""
    shape = check_qkv(q, k, v)
    check_tiling(block, key_tile, cells)
    fused_choice(q, v, fused, softcap)  # an impossible fused=True fails here, while tracing
    k, v = broadcast_kv(k, shape.B), broadcast_kv(v, shape.B)
    if bias is not None:  # viewed as (B|1, H|1, T|1, S|1)
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    if sinks is not None:  # (B|1, H|1, T|1), in the accumulator dtype
        sinks = check_sinks(sinks, q, shape)
    flat = flatten(mask)
    static = (flat.description, flat.ints, flat.floats, scale, q_offset, softcap, block,
              key_tile, cells, windows, fused)  # fmt: skip
    return TracedTiled.apply(q, k, v, bias, sinks, flat.tensors, static)


class TracedTiled(torch.autograd.Function):
    """The forward op with the backward op as its gradient, for torch.func's transforms too:
    the op's own ``register_autograd`` formula lacks the ``setup_context`` that grad and jacrev
    need (pytorch/pytorch#168393); vmap reaches the two ops' own rules."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None,
        mask_tensors: list[Tensor], static: tuple,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return tiled_forward_op(q, k, v, bias, sinks, mask_tensors, *static)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
        q, k, v, bias, sinks, mask_tensors, static = inputs
        _setup_context(ctx, (q, k, v, bias, sinks, mask_tensors, *static), output)

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Tensor | None) -> tuple:
        grads = _backward(ctx, dout, dlse)
        return (*grads[:5], None, None)


# --- the forward op ------------------------------------------------------------------------------


@torch.library.custom_op("dikkat::tiled_forward", mutates_args=())
def tiled_forward_op(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None,
    mask_tensors: list[Tensor], mask: str, mask_ints: list[int], mask_floats: list[float],
    scale: float, q_offset: int, softcap: float | None, block: int | None, key_tile: int,
    cells: int, windows: bool | None, fused: bool | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (B, H, T, Dv), lse (B, H, T))`` of q (B, H, T, D) over k, v (B, G, S, ·), the
    bias (B|1, H|1, T|1, S|1) and sinks (B|1, H|1, T|1) as :func:`traced_tiled_attention`
    passes them, the mask as :func:`~dikkat.core.mask_flat.flatten` gives it."""
    m = rebuild(mask, mask_tensors, mask_ints, mask_floats)
    q, k, v, prepared, use_fused = ready(q, k, v, m, bias, q_offset, block, key_tile, cells,
                                         windows, fused, softcap, None)  # fmt: skip
    return forward(q, k, v, scale, bias, prepared, key_tile, use_fused, softcap, sinks)


@tiled_forward_op.register_fake
def _forward_fake(q: Tensor, k: Tensor, v: Tensor, *_: object) -> tuple[Tensor, Tensor]:
    B, H, T, _ = q.shape
    return q.new_empty(B, H, T, v.shape[3]), q.new_empty(B, H, T, dtype=acc_dtype(q.dtype))


# --- the backward op -----------------------------------------------------------------------------


@torch.library.custom_op("dikkat::tiled_backward", mutates_args=())
def tiled_backward_op(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, bias: Tensor | None,
    sinks: Tensor | None, mask_tensors: list[Tensor], mask: str, mask_ints: list[int],
    mask_floats: list[float], scale: float, q_offset: int, softcap: float | None,
    block: int | None, key_tile: int, cells: int, windows: bool | None, fused: bool | None,
    bias_grad: bool, sinks_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv, dbias, dsinks)`` of :func:`tiled_forward_op` given its ``out``, ``lse``
    and the gradient ``dout``; dbias and dsinks empty (shape (0,)) unless asked for."""
    m = rebuild(mask, mask_tensors, mask_ints, mask_floats)
    q, k, v, prepared, use_fused = ready(q, k, v, m, bias, q_offset, block, key_tile, cells,
                                         windows, fused, softcap, None)  # fmt: skip
    out = unit_last_stride(out) if use_fused else out
    dq, dk, dv, dbias = backward(q, k, v, out, lse.contiguous(), dout.contiguous(), scale, bias,
                                 prepared, key_tile, use_fused, softcap, bias_grad)  # fmt: skip
    none = q.new_empty(0)
    dsinks = sinks_gradient(dout, out, lse, sinks) if sinks_grad else none.clone()
    return dq, dk, dv, none if dbias is None else dbias, dsinks


@tiled_backward_op.register_fake
def _backward_fake(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    bias: Tensor | None, sinks: Tensor | None, *rest: object,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    bias_grad, sinks_grad = rest[-2:]
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)  # type: ignore[union-attr]
    dsinks = sinks.new_empty(sinks.shape) if sinks_grad else q.new_empty(0)  # type: ignore[union-attr]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsinks


# --- autograd ------------------------------------------------------------------------------------


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, bias, sinks, mask_tensors, *static = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, sinks, *mask_tensors)
    ctx.static = tuple(static)  # the mask's description and numbers, scale, ..., the tiling
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None) -> tuple:
    legacy = legacy_vmapped(dout)
    if legacy is not None:
        return per_entry(lambda d: _backward(ctx, d, None), *legacy)
    q, k, v, out, lse, bias, sinks, *mask_tensors = ctx.saved_tensors
    bias_grad = bias is not None and bool(ctx.needs_input_grad[3])
    sinks_grad = sinks is not None and bool(ctx.needs_input_grad[4])
    dq, dk, dv, dbias, dsinks = tiled_backward_op(
        q, k, v, out, lse, dout, bias, sinks, mask_tensors, *ctx.static, bias_grad, sinks_grad
    )
    grads = (dq, dk, dv, dbias if bias_grad else None, dsinks if sinks_grad else None)
    # one None per input; an empty list for an empty list (autograd's structure check)
    no_grads = ([] if arg == [] else None for arg in ctx.static)
    return (*grads, [None] * len(mask_tensors), *no_grads)


tiled_forward_op.register_autograd(_backward, setup_context=_setup_context)


# --- vmap: the vmapped dim folded into the batch -------------------------------------------------


def _front(x: Tensor, bdim: int | None, n: int) -> Tensor:
    """x with its vmapped dim first (an unvmapped x expanded to n entries there)."""
    return x.movedim(bdim, 0) if bdim is not None else x.expand(n, *x.shape)


def _fold(x: Tensor | None, bdim: int | None, n: int, B: int, shared: bool) -> Tensor | None:
    """(n·B, ·) rows of x, whose dim 0 (past the vmapped one) is the batch, B or 1; ``shared``:
    an unvmapped x of batch size 1 may stay as it is (it broadcasts over every row)."""
    if x is None:
        return None
    if shared and bdim is None and x.shape[0] == 1:
        return x
    x = _front(x, bdim, n)
    return x.expand(n, B, *x.shape[2:]).flatten(0, 1)


def _unfold(x: Tensor, n: int, B: int, like: Tensor, bdim: int | None) -> Tensor:
    """A gradient of n·B rows back to (n, ·) and the batch size of ``like`` (B or 1, past its
    vmapped dim ``bdim``): summed over the batch for a ``like`` shared by the batch."""
    x = x.unflatten(0, (n, B))
    return x.sum(1, keepdim=True) if _batch(like, bdim) == 1 and B != 1 else x


def _mask_tensors(mask: str, tensors: list[Tensor], dims: list, n: int) -> list[Tensor]:
    """The mask's tensors for n·B rows: one of batch size B > 1 repeated n times along dim 0."""
    for name, dim in zip(tensor_names(mask), dims, strict=True):
        if dim is not None:
            raise ValueError(
                f"the tiled backend cannot vmap over a mask's tensor ({name}): build the mask "
                "outside the vmapped function, or give each entry its own call"
            )
    return [t if t.shape[0] == 1 else t.repeat(n, *(1,) * (t.dim() - 1)) for t in tensors]


def _loop(op: Any, info: Any, in_dims: tuple, args: tuple) -> tuple[tuple, tuple]:
    """The op once per vmapped entry (a caller's own mask: folding would change its batch)."""

    def entry(i: int) -> list:
        return [
            a if d is None or not isinstance(a, Tensor) else a.select(d, i)
            for a, d in zip(args, in_dims, strict=True)
        ]

    results = [op(*entry(i)) for i in range(info.batch_size)]
    outs = tuple(torch.stack(parts) for parts in zip(*results, strict=True))
    return outs, (0,) * len(outs)


@tiled_forward_op.register_vmap
def _forward_vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[tuple, tuple]:
    q, k, v, bias, sinks, tensors, mask, *static = args
    qd, kd, vd, bd, sd, md = in_dims[:6]
    n = info.batch_size
    tensors = _mask_tensors(mask, tensors, md, n)
    if not builtin_only(mask):
        return _loop(tiled_forward_op, info, in_dims, args)
    B = _batch(q, qd)
    q, k, v = (_fold(x, d, n, B, False) for x, d in ((q, qd), (k, kd), (v, vd)))
    bias, sinks = _fold(bias, bd, n, B, True), _fold(sinks, sd, n, B, True)
    out, lse = tiled_forward_op(q, k, v, bias, sinks, tensors, mask, *static)
    return (out.unflatten(0, (n, B)), lse.unflatten(0, (n, B))), (0, 0)


def _batch(x: Tensor, bdim: int | None) -> int:
    """The batch size B of a (B, ·, ·, ·) input, past its vmapped dim."""
    return _front(x, bdim, 1).shape[1]


@tiled_backward_op.register_vmap
def _backward_vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[tuple, tuple]:
    q, bias, sinks, tensors, mask, static = args[0], *args[6:10], args[10:]
    qd, bd, sd, md = in_dims[0], *in_dims[6:9]
    n = info.batch_size
    tensors = _mask_tensors(mask, tensors, md, n)
    if not builtin_only(mask):
        return _loop(tiled_backward_op, info, in_dims, args)
    B = _batch(q, qd)
    rows = [_fold(x, d, n, B, False) for x, d in zip(args[:6], in_dims[:6], strict=True)]
    # the bias and sinks as n·B rows, so that their gradient comes back per vmapped entry
    bias_n, sinks_n = _fold(bias, bd, n, B, False), _fold(sinks, sd, n, B, False)
    dq, dk, dv, dbias, dsinks = tiled_backward_op(*rows, bias_n, sinks_n, tensors, mask, *static)
    bias_grad, sinks_grad = static[-2:]
    grads = [g.unflatten(0, (n, B)) for g in (dq, dk, dv)]
    grads.append(_unfold(dbias, n, B, bias, bd) if bias_grad else dbias)
    grads.append(_unfold(dsinks, n, B, sinks, sd) if sinks_grad else dsinks)
    return tuple(grads), (0, 0, 0, 0 if bias_grad else None, 0 if sinks_grad else None)
