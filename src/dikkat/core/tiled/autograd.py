"""The tiled forward and backward passes over a plan, and the autograd function joining them.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``g = H / G`` query heads per
key/value head, ``T``/``S`` query/key length, ``D``/``Dv`` head dims, ``R`` rows of a tile,
``n`` query blocks of a windows tile.

Forward: each tile of rows runs its key tiles in turn, merged by the online softmax in log space
(a running log-sum-exp per row; out = Σ exp(lse_tile − lse) · out_tile), so no row ever needs
all its scores at once; each windows tile is one kernel call. Backward recomputes each tile's
weights from the saved log-sum-exp, following the same plan and tile masks, so training memory
is O(n) too. ``softcap`` (None or c > 0) caps each tile's scaled scores, c · tanh(s / c), before
its mask and bias (:mod:`~dikkat.core.tiled.kernel`); the caller runs such a call unfused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from dikkat.core.tiled.cache import Prepared
from dikkat.core.tiled.gather import Gathered, from_kernel, gather, stack, to_kernel, unstack
from dikkat.core.tiled.kernel import (
    acc_dtype,
    add_bias_grad,
    plain_tile_backward,
    tile_backward,
    tile_forward,
)
from dikkat.core.tiled.plan import Rows, Windows
from dikkat.core.tiled.sinks import add_sinks, sinks_grad
from dikkat.core.tiled.tile_masks import TileMask

UNMASKED = TileMask(None, None)  # a tile whose every pair is allowed


def bias_tile(bias: Tensor | None, G: int, q0: int, q1: int, k0: int, k1: int) -> Tensor | None:
    """The bias (B|1, H|1, T|1, S|1) entries of one tile, viewable against (B, G, g, rows, keys)."""
    if bias is None:
        return None
    rows = slice(q0, q1) if bias.shape[2] > 1 else slice(None)
    cols = slice(k0, k1) if bias.shape[3] > 1 else slice(None)
    t = bias[:, :, rows, cols]
    Bb, Hb = t.shape[0], t.shape[1]
    return t.view(Bb, 1, 1, *t.shape[2:]) if Hb == 1 else t.reshape(Bb, G, Hb // G, *t.shape[2:])


def rows_bias(
    bias: Tensor | None, G: int, g: int, r0: int, r1: int, k0: int, k1: int
) -> Tensor | None:
    """The bias of rows r0:r1 against keys k0:k1 in a rows tile's layout (B|1, G|1, g·R, K)."""
    t = bias_tile(bias, G, r0, r1, k0, k1)
    if t is None:
        return None
    return stack(t.expand(t.shape[0], t.shape[1], g, r1 - r0, k1 - k0))


def with_bias(additive: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """The tile's mask plus its bias, in the bias's dtype (fp32 for bf16 q: the CPU kernel
    takes a wider float mask and adds it in fp32)."""
    if bias is None:
        return additive
    return bias if additive is None else additive + bias


def rows_tiles(
    i: int, item: Rows, prepared: Prepared, key_tile: int, device: torch.device
) -> Iterator[tuple[int, int, TileMask]]:
    """(k0, k1, tile mask) of each key tile of rows item i that the mask does not hide; a
    tile every row sees whole needs no mask at all."""
    for k0, k1, full in item.key_tiles(key_tile):
        tm = UNMASKED if full else prepared.masks.rows(i, item, k0, k1, device)
        if tm is not False:
            yield k0, k1, tm  # type: ignore[misc]


def _rows_forward(
    i: int, item: Rows, q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None,
    prepared: Prepared, key_tile: int, fused: bool, softcap: float | None, out: Tensor,
    lse: Tensor,
) -> None:  # fmt: skip
    """Rows item i of q (B, G, g, T, D) into out (B, G, g, T, Dv) and lse (B, G, g, T)."""
    B, G, g, _, _ = q.shape
    r0, r1 = item.r0, item.r1
    qb = stack(q[:, :, :, r0:r1])  # (B, G, g·R, D)
    total_out = total_lse = None
    for k0, k1, tm in rows_tiles(i, item, prepared, key_tile, q.device):
        additive = with_bias(tm.additive, rows_bias(bias, G, g, r0, r1, k0, k1))
        kb, vb = k[:, :, k0:k1], v[:, :, k0:k1]
        o, l = tile_forward(qb, kb, vb, additive, scale, fused, softcap)  # noqa: E741
        if tm.unseen is not None:  # rows with no visible key in this tile
            l = l.masked_fill(tm.unseen, float("-inf"))  # noqa: E741
        if total_out is None:
            total_out, total_lse = o, l
            continue
        # the online softmax across key tiles, in log space: weights exp(lse_tile − lse_new)
        new = torch.logaddexp(total_lse, l)
        safe = new.masked_fill(torch.isneginf(new), 0.0)
        total_out = total_out * torch.exp(total_lse - safe).unsqueeze(-1) + o * torch.exp(
            l - safe
        ).unsqueeze(-1)
        total_lse = new
    if total_out is not None:
        out[:, :, :, r0:r1] = unstack(total_out, g)
        lse[:, :, :, r0:r1] = unstack(total_lse.expand(B, G, -1), g)


def _windows_forward(
    i: int, item: Windows, q: Tensor, k: Tensor, v: Tensor, scale: float, prepared: Prepared,
    fused: bool, softcap: float | None, out: Tensor, lse: Tensor,
) -> None:  # fmt: skip
    """Windows item i of q (B, G, g, T, D) into out and lse, as :func:`_rows_forward`."""
    t = gather(item, q, k, v, prepared.block)
    B, G, g = q.shape[:3]
    n = item.starts.numel()
    tm = prepared.masks.windows(i, item, q.device)
    o, l = tile_forward(t.q, t.k, t.v, tm.additive, scale, fused, softcap)  # noqa: E741 — (B·G, n, g·block, ·)
    if tm.unseen is not None:
        l = l.view(B, G, n, -1).masked_fill(tm.unseen, float("-inf"))  # noqa: E741
    t.scatter(out, from_kernel(o, B, G, g))
    t.scatter(lse.unsqueeze(-1), from_kernel(l.reshape(B * G, n, -1, 1), B, G, g))


def forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None, prepared: Prepared,
    key_tile: int, fused: bool, softcap: float | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out (B, H, T, Dv) in q's dtype, lse (B, H, T) in the accumulator dtype); ``sinks``
    (B|1, H|1, T|1) join each row's softmax after its key tiles (:mod:`~.sinks`)."""
    B, H, T, D = q.shape
    G, Dv = k.shape[1], v.shape[3]
    qg = q.reshape(B, G, H // G, T, D)  # (B, G, g, T, D): query heads grouped by kv head
    acc = acc_dtype(q.dtype)
    if prepared.covers:  # every row is written by some tile
        out = torch.empty(B, G, H // G, T, Dv, dtype=acc, device=q.device)
        lse = torch.empty(B, G, H // G, T, dtype=acc, device=q.device)
    else:  # rows that no tile writes see no key: output 0, lse −inf
        out = torch.zeros(B, G, H // G, T, Dv, dtype=acc, device=q.device)
        lse = torch.full((B, G, H // G, T), float("-inf"), dtype=acc, device=q.device)
    for i, item in enumerate(prepared.plan):
        if isinstance(item, Windows):
            _windows_forward(i, item, qg, k, v, scale, prepared, fused, softcap, out, lse)
        else:
            _rows_forward(
                i, item, qg, k, v, scale, bias, prepared, key_tile, fused, softcap, out, lse
            )
    out, lse = out.view(B, H, T, Dv), lse.view(B, H, T)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float,
    bias: Tensor | None, prepared: Prepared, key_tile: int, fused: bool, softcap: float | None,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """(dq, dk, dv, dbias): dbias (the bias's 4-D shape) when ``bias_grad``, else None."""
    B, H, T, D = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    g = H // G
    acc = acc_dtype(q.dtype)
    qg, og, dog = (x.reshape(B, G, g, T, x.shape[3]) for x in (q, out, dout))
    # rows with no visible key (lse = −inf) get weight 0 through the mask; any finite lse does
    lse_g = lse.view(B, G, g, T).masked_fill(torch.isneginf(lse.view(B, G, g, T)), 0.0)
    dq = torch.zeros(B, G, g, T, D, dtype=acc, device=q.device)
    dk = torch.zeros(B, G, S, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, G, S, Dv, dtype=acc, device=q.device)
    dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if bias_grad else None
    for i, item in enumerate(prepared.plan):
        if isinstance(item, Windows):
            t = gather(item, qg, k, v, prepared.block)
            n = item.starts.numel()

            def windows(x: Tensor, t: Gathered = t, n: int = n) -> Tensor:
                """(B, G, g, T, ·) → this tile's rows in the kernel's layout."""
                rows = t.take(x)
                if t.view is None and not bool(t.real.all()):
                    rows = rows * t.real.view(n, -1, 1)  # padding rows: no gradient
                return to_kernel(rows)

            tm = prepared.masks.windows(i, item, q.device)
            dob, ob, lb = windows(dog), windows(og), windows(lse_g.unsqueeze(-1)).squeeze(-1)
            dqb, dkb, dvb = tile_backward(
                dob, t.q, t.k, t.v, ob, lb, tm.additive, scale, fused, softcap
            )
            t.scatter(dq, from_kernel(dqb, B, G, g).to(acc))
            index = t.index.flatten()
            dk.index_add_(2, index, dkb.reshape(B, G, -1, D).to(acc))
            dv.index_add_(2, index, dvb.reshape(B, G, -1, Dv).to(acc))
            continue
        r0, r1 = item.r0, item.r1
        qb, ob, dob = (stack(x[:, :, :, r0:r1]) for x in (qg, og, dog))
        lb = stack(lse_g[:, :, :, r0:r1].unsqueeze(-1)).squeeze(-1)
        for k0, k1, tm in rows_tiles(i, item, prepared, key_tile, q.device):
            additive = with_bias(tm.additive, rows_bias(bias, G, g, r0, r1, k0, k1))
            tile = (dob, qb, k[:, :, k0:k1], v[:, :, k0:k1], ob, lb, additive, scale)
            if dbias is None:
                dqb, dkb, dvb = tile_backward(*tile, fused, softcap)
            else:  # the fused kernel's backward gives no dS: plain ops for this tile
                dqb, dkb, dvb, ds = plain_tile_backward(*tile, softcap)
                add_bias_grad(dbias, ds, g, r0, r1, k0, k1)
            dq[:, :, :, r0:r1] += unstack(dqb.to(acc), g)
            dk[:, :, k0:k1] += dkb.to(acc)
            dv[:, :, k0:k1] += dvb.to(acc)
    dbias = None if dbias is None else dbias.to(bias.dtype)  # type: ignore[union-attr]
    return dq.view(B, H, T, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


def legacy_vmapped(dout: Tensor) -> tuple[Tensor, int] | None:
    """``(physical (N, ·) tensor, vmap level)`` of a gradient batched by the legacy
    ``torch._vmap_internals.vmap`` — what ``gradcheck(check_batched_grad=True)`` runs a backward
    under (torch/autograd/gradcheck.py, ``_test_batched_grad``) — else None. Its batching
    rules cannot follow a backward that writes tiles into plain buffers; each entry runs apart."""
    if torch.compiler.is_compiling() or not torch._C._functorch.is_legacy_batchedtensor(dout):
        return None  # (a compiled graph never holds one; dynamo cannot ask)
    level = torch._C._vmapmode_increment_nesting() - 1  # the innermost level: dout's
    torch._C._vmapmode_decrement_nesting()
    return torch._remove_batch_dim(dout, level, 1, 0), level


def per_entry(grads: Callable[[Tensor], tuple], physical: Tensor, level: int) -> tuple:
    """``grads`` of each entry of a legacy-vmapped gradient (:func:`legacy_vmapped`), stacked
    and batched again at ``level`` (a None gradient stays None)."""
    parts = [grads(entry) for entry in physical.unbind(0)]
    return tuple(
        None if p[0] is None else torch._add_batch_dim(torch.stack(p), 0, level)
        for p in zip(*parts, strict=True)
    )


class TiledAttention(torch.autograd.Function):
    """``(out, lse)`` of a prepared plan; differentiable in q, k, v, the bias and the sinks."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None,
        prepared: Prepared, key_tile: int, fused: bool, softcap: float | None,
        sinks: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        out, lse = forward(q, k, v, scale, bias, prepared, key_tile, fused, softcap, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (scale, bias, prepared, key_tile, fused, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        legacy = legacy_vmapped(dout)
        if legacy is not None:
            return per_entry(lambda d: TiledAttention.backward(ctx, d, None), *legacy)
        q, k, v, out, lse, sinks = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[4]
        dq, dk, dv, dbias = backward(q, k, v, out, lse, dout.contiguous(), *ctx.args, bias_grad)
        dsinks = None
        if ctx.needs_input_grad[9]:  # the sinks: a score with value 0 in every row's softmax
            dsinks = sinks_grad(dout, out, lse, sinks)
        return dq, dk, dv, None, dbias, None, None, None, None, dsinks
