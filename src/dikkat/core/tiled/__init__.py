"""Exact attention over tiles with the online softmax: the T×S score matrix never exists.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (``g = H / G`` query heads per
key/value head), ``T``/``S`` query/key length, ``D``/``Dv`` head dims, ``W`` window width.

The queries are cut into blocks, and the mask's ``kv_range`` bounds the keys each block can
see. A *plan* (:mod:`~dikkat.core.tiled.plan`) groups the work into tiles of at most ``cells``
score cells, either runs of query rows in key tiles of at most ``key_tile`` keys — the online
softmax (Milakov & Gimelshein 2018, arXiv:1805.02867; FlashAttention, Dao et al. 2022,
arXiv:2205.14135) carries each row's maximum and sum across them, a key tile the mask hides is
skipped and one it shows entirely runs unmasked — or, when the key ranges slide (a sliding
window, packed documents), one key window per block, the windows of many blocks in one kernel
call (:mod:`~dikkat.core.tiled.gather`), so a band of width w costs O(T·w).

The mask is evaluated once per tile into an additive 0/−inf tensor and kept
(:mod:`~dikkat.core.tiled.tile_masks`); a plan cache keyed on the mask's parameters (built-in
masks only; :mod:`~dikkat.core.tiled.cache`) keeps the plan and its tile masks across calls, as
flex keeps its block masks. Each tile (:mod:`~dikkat.core.tiled.kernel`) runs on CPU in
PyTorch's fused flash kernel, elsewhere in plain tensor ops; the backward pass
(:mod:`~dikkat.core.tiled.autograd`) recomputes each tile from the saved log-sum-exp.
:func:`tiled_backward` runs that backward on its own, for one block of keys of a larger softmax
given its final output and log-sum-exp (what blockwise and ring attention need). Under
torch.compile, torch.export or a torch.func transform (:func:`dikkat.core.tracing.tracing`)
:func:`tiled_attention` runs as one custom op instead (:mod:`~dikkat.core.tiled.traced`): the
same eager code inside it, no host read outside it.

Extra memory is O((T + S)·D + cells), never O(T·S), plus the kept tile masks (at most
``PlanCache.kept_mask_bytes`` per plan, for the few plans the cache holds); training memory is
O(n) too.

What differs from the reference: the sum runs in a different order (so results differ by
rounding), matmuls run in the input dtype but the softmax statistics and accumulators in fp32
(fp64 for fp64 inputs), and there is no dropout. Rows with every key masked give output 0 and
``lse = −inf``; a call with no score cells (B, T or S = 0) gives zeros. A bias is added in fp32
(fp64 for fp64 inputs), and it is differentiable: a tile whose bias needs a gradient runs the
plain-ops backward, which also gives the scores' gradient. With ``softcap`` c each tile caps its
scaled scores, c · tanh(s / c), before the mask and the bias, as the reference does; the fused
CPU kernel cannot, so a soft-capped call runs every tile in plain ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dikkat.core.checks import (
    broadcast_kv,
    check_mask,
    check_qkv,
    check_scale,
    check_sinks,
    check_softcap,
)
from dikkat.core.masks import Mask
from dikkat.core.tiled.autograd import TiledAttention, backward
from dikkat.core.tiled.cache import KEPT_MASK_BYTES, PlanCache, plans
from dikkat.core.tiled.call import fused_choice, prepared_for, ready, windows_layout
from dikkat.core.tiled.kernel import unit_last_stride
from dikkat.core.tiled.plan import BLOCK, CELLS, KEY_TILE, Windows, windows_cells
from dikkat.core.tiled.traced import traced_tiled_attention
from dikkat.core.tracing import tracing

__all__ = [
    "BLOCK",
    "CELLS",
    "KEPT_MASK_BYTES",
    "KEY_TILE",
    "PlanCache",
    "PlanSummary",
    "plan_summary",
    "plans",
    "tiled_attention",
    "tiled_backward",
]


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    bias: Tensor | None = None,
    q_offset: int = 0,
    block: int | None = None,
    key_tile: int = KEY_TILE,
    cells: int = CELLS,
    windows: bool | None = None,
    fused: bool | None = None,
    plans: PlanCache | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention in tiles: ``(out (B, H, T, Dv), lse (B, H, T))``, lse in fp32 (fp64 for
    fp64 inputs). Differentiable in q, k, v, the bias and the sinks.

    Args:
        q, k, v, mask, scale, softcap, bias, q_offset: as in :func:`dikkat.attention` (``mask``
            a :class:`~dikkat.core.masks.Mask` or None, ``softcap`` None or a positive finite
            float, ``bias`` broadcastable to (B, H, T, S), k and v of batch size B or 1); the
            lse is that of the capped scores.
        block: query rows per block; None: :data:`BLOCK`, or for windows the size the plan
            finds fastest on this device (:func:`~dikkat.core.tiled.plan.choose_block`).
        key_tile: keys per tile in a run of rows; cells: score cells per tile, over batch and
            heads.
        windows: force (True) or forbid (False) gathered key windows, which need a mask and no
            bias (with a bias the plan is of rows); None: the mask's key ranges decide.
        fused: run each tile in PyTorch's fused CPU flash kernel (True: fail if this call cannot,
            e.g. off the CPU, with Dv ≠ D or with a softcap, which that kernel cannot apply), in
            plain tensor ops (False), or None: the kernel wherever it can run.
        plans: the plan cache to use; None: the shared :data:`plans`.
        sinks: attention sinks as in :func:`dikkat.attention`, (H,) or 3-D broadcastable to
            (B, H, T), finite: one more logit per row in the softmax's denominator, joined after
            the key tiles (:mod:`~dikkat.core.tiled.sinks`); the lse counts them.
    """
    softcap = check_softcap(softcap)
    if tracing():  # no host reads: one custom op runs the eager path inside the graph
        return traced_tiled_attention(
            q, k, v, mask, scale=scale, softcap=softcap, bias=bias, q_offset=q_offset,
            block=block, key_tile=key_tile, cells=cells, windows=windows, fused=fused,
            sinks=sinks,
        )  # fmt: skip
    q, k, v, prepared, use_fused = ready(q, k, v, mask, bias, q_offset, block, key_tile, cells,
                                         windows, fused, softcap, plans)  # fmt: skip
    if bias is not None:  # viewed as (B|1, H|1, T|1, S|1)
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    if sinks is not None:  # (B|1, H|1, T|1), in the accumulator dtype
        sinks = check_sinks(sinks, q, check_qkv(q, k, v))
    return TiledAttention.apply(q, k, v, scale, bias, prepared, key_tile, use_fused, softcap, sinks)


def _check_result(name: str, t: Tensor, shape: tuple[int, ...], q: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"{name} must have shape {shape} (from q {tuple(q.shape)} and v), got {tuple(t.shape)}"
        )
    if name != "lse" and t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")


def tiled_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    q_offset: int = 0,
    block: int | None = None,
    key_tile: int = KEY_TILE,
    cells: int = CELLS,
    windows: bool | None = None,
    fused: bool | None = None,
    plans: PlanCache | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients ``(dq, dk, dv)`` of this block of keys given the final ``out`` and ``lse``
    of a larger softmax: attention of q over a set of keys of which k, v are a part.

    Blockwise attention (ring attention, split-key decoding) cuts the keys into blocks and
    merges each block's partial result by its log-sum-exp. Its backward needs, per block, the
    block's share of the gradients: with P = exp(s − lse) recomputed from the *final* lse and
    delta = rowsum(dO ⊙ O) of the *final* output (FlashAttention-2, Dao 2023, arXiv:2307.08691,
    Algorithm 2), dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ − delta), dQ = dS K · scale, dK = dSᵀ Q · scale.
    Summed over blocks that partition the keys, these are the gradients of the whole attention;
    for a single block, with ``out, lse = tiled_attention(...)``, they are what its autograd
    gives. It runs the plan, tile masks and kernels of :func:`tiled_attention`'s backward.

    Args:
        q (B, H, T, D), k (B|1, G, S, D), v (B|1, G, S, Dv): the queries and this block's keys
            and values.
        out (B, H, T, Dv), dout: the final output (over every block) and its gradient, in q's
            dtype; lse (B, H, T): the final log-sum-exp (−inf for rows that see no key at all).
        mask, scale, softcap, q_offset: as in :func:`tiled_attention`, on this block's keys
            (``q_offset`` places query 0 among them; ``mask`` may also be a bool tensor
            broadcastable to (B, H, T, S)).
        block, key_tile, cells, windows, fused, plans: the tiling, as in
            :func:`tiled_attention`.

    Returns:
        dq (B, H, T, D), dk and dv of k's and v's shapes (summed over the batch for k, v of
        batch size 1), in q's dtype.
    """
    shape = check_qkv(q, k, v)
    B, H, T = shape.B, shape.H, shape.T
    _check_result("out", out, (B, H, T, shape.Dv), q)
    _check_result("dout", dout, (B, H, T, shape.Dv), q)
    _check_result("lse", lse, (B, H, T), q)
    scale, softcap = check_scale(scale, shape.D), check_softcap(softcap)
    mask = check_mask(mask, shape, q_offset)
    use_fused = fused_choice(q, v, fused, softcap)
    kb, vb = k, v
    if use_fused:  # as in tiled_attention: copied once here, not once per tile
        q, kb, vb, out = (unit_last_stride(t) for t in (q, k, v, out))
    kb, vb = broadcast_kv(kb, B), broadcast_kv(vb, B)
    prepared = prepared_for(q, kb, mask, None, q_offset, block, key_tile, cells, windows, plans)
    kb, vb = windows_layout(prepared, kb, vb)
    dq, dk, dv, _ = backward(q, kb, vb, out, lse, dout.contiguous(), scale, None, prepared,
                             key_tile, use_fused, softcap, False)  # fmt: skip
    if k.shape[0] != B:  # one k, v for the whole batch: its gradient is the batch's sum
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return dq, dk, dv


@dataclass(frozen=True)
class PlanSummary:
    """What a tiled call computes: its plan in numbers (:func:`plan_summary`)."""

    kind: str  # "rows", "windows", or "empty" (no score cells)
    block: int  # query rows per block
    tiles: int  # kernel calls of the forward pass (key tiles the mask hides not counted)
    skipped_tiles: int  # key tiles of rows the mask hides entirely: never computed
    windows: int  # query blocks given a key window of their own (0 for a plan of rows)
    computed_cells: int  # score cells the forward pass computes, over batch and heads
    total_cells: int  # B·H·T·S, what the reference or SDPA computes
    kept_mask_bytes: int  # tile masks the plan keeps, shared by forward and backward

    @property
    def computed_fraction(self) -> float:
        """The share of the score matrix computed (0 for a call with no score cells)."""
        return self.computed_cells / self.total_cells if self.total_cells else 0.0


def plan_summary(
    q: Tensor,
    k: Tensor,
    mask: Mask | None = None,
    *,
    bias: Tensor | None = None,
    q_offset: int = 0,
    block: int | None = None,
    key_tile: int = KEY_TILE,
    cells: int = CELLS,
    windows: bool | None = None,
    plans: PlanCache | None = None,
) -> PlanSummary:
    """The plan :func:`tiled_attention` runs for these arguments, in numbers: its shape, block
    size, tiles, the cells it computes and the tile masks it keeps. Only the shapes, dtype and
    device of q and k matter. It prepares the plan exactly as the call does — through the same
    plan cache, building every tile mask — so a call after it reuses the work."""
    prepared = prepared_for(q, k, mask, bias, q_offset, block, key_tile, cells, windows, plans)
    B, H, _, T, S = prepared.masks.shape
    block_ = prepared.block
    tiles = skipped = computed = n_windows = 0
    for i, item in enumerate(prepared.plan):
        if isinstance(item, Windows):
            prepared.masks.windows(i, item, q.device)
            tiles += 1
            n_windows += item.starts.numel()
            computed += windows_cells([item], block_)
            continue
        for k0 in range(item.k0, item.k1, key_tile):
            k1 = min(k0 + key_tile, item.k1)
            if prepared.masks.rows(i, item, k0, k1, q.device) is False:
                skipped += 1
            else:
                tiles += 1
                computed += (item.r1 - item.r0) * (k1 - k0)
    if not prepared.plan:  # no score cells
        kind = "empty"
    else:
        kind = "windows" if isinstance(prepared.plan[0], Windows) else "rows"
    return PlanSummary(
        kind=kind,
        block=block_,
        tiles=tiles,
        skipped_tiles=skipped,
        windows=n_windows,
        computed_cells=computed * B * H,
        total_cells=B * H * T * S,
        kept_mask_bytes=prepared.masks.nbytes,
    )
