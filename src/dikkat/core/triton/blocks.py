"""Which key blocks each query block visits, and how: the block plan, built on the host.

Notation: ``B`` batch, ``H`` query heads, ``T``/``S`` query/key length, ``BM``/``BN`` query/key
rows per block, ``nm``/``nn`` query/key blocks, ``P`` partial blocks whose mask is a tile.

The (T, S) score grid is cut into BM × BN blocks, and each (query block, key block) pair is

- *skipped* — outside the mask's :meth:`~dikkat.core.masks.Mask.kv_range` for that query block,
  or a partial block in which no pair is allowed: its keys are never loaded;
- *full* — inside :meth:`~dikkat.core.masks.Mask.kv_full_range` (or a block whose every pair is
  allowed): run with no mask but the ragged tail's bound;
- *partial* — the rest: the mask is evaluated elementwise on this block alone, in the kernel for
  a *band* (causal and sliding window are a function of ``q − k``), else from a bool tile that the
  mask's predicate fills here on the host, for the partial blocks only.

That is the shape of FlexAttention's block masks (``kv_num_blocks`` / ``kv_indices`` and their
``full_`` twins, https://pytorch.org/blog/flexattention/), reached from dikkat's key ranges
instead of a pass over the whole grid. The visits are kept twice, as compressed rows (by query
block: the forward pass and dQ) and compressed columns (by key block: dK and dV). Plans are
cached (:data:`block_plans`), keyed like flex's block masks (:mod:`dikkat.core.mask_keys`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.mask_keys import describe, is_builtin, tensor_identity
from dikkat.core.masks import Causal, Mask, SlidingWindow

__all__ = ["BlockPlan", "BlockPlanCache", "band_of", "block_plans", "plan_blocks"]

# a distance no call reaches: the causal band's open upper end (fits the kernels' int32)
_FAR = 2**30
FULL = -1  # the tile number of a full block; skipped blocks are not listed at all


@dataclass(frozen=True)
class Visits:
    """Compressed visits: outer block i visits inner blocks ``inner[ptr[i]:ptr[i + 1]]``, whose
    mask tile is ``tile`` at the same place (:data:`FULL`: none)."""

    ptr: Tensor  # (n_outer + 1,) int32
    inner: Tensor  # (visits,) int32
    tile: Tensor  # (visits,) int32


@dataclass(frozen=True)
class BlockPlan:
    """A call's block visits and the mask tiles of its partial blocks."""

    block_m: int
    block_n: int
    rows: Visits  # by query block: the key blocks it visits
    cols: Visits  # by key block: the query blocks that visit it
    tiles: Tensor  # (P | 1, B | 1, H | 1, BM, BN) int8, 1 = may attend (a dummy one when P = 0)
    band: tuple[int, int] | None  # (lo, hi): the pair (q, k) is allowed iff lo ≤ q − k < hi

    @property
    def partial(self) -> int:
        """Partial blocks whose mask is a tile."""
        return int((self.rows.tile >= 0).sum())

    def tile_strides(self) -> tuple[int, int, int]:
        """The tiles' strides over (tile, batch, head); 0 for a dimension of size 1."""
        Bm, Hm = self.tiles.shape[1:3]
        cell = self.block_m * self.block_n
        return Hm * Bm * cell, (Hm * cell if Bm > 1 else 0), (cell if Hm > 1 else 0)


def band_of(mask: Mask | None) -> tuple[int, int] | None:
    """The distances ``q − k`` a mask allows, when it is a band the kernel evaluates itself."""
    if type(mask) is Causal:
        return 0, _FAR
    if type(mask) is SlidingWindow:
        return -mask.ahead, mask.window
    return None


def _compress(status: Tensor) -> Visits:
    """(n_outer, n_inner) statuses (a tile number, FULL, or < FULL: skipped) as Visits."""
    outer, inner = (status >= FULL).nonzero(as_tuple=True)  # row-major: inner ascending
    counts = torch.bincount(outer, minlength=status.shape[0])
    ptr = torch.zeros(status.shape[0] + 1, dtype=torch.int64)
    ptr[1:] = counts.cumsum(0)
    return Visits(ptr.int(), inner.int(), status[outer, inner].int())


def _ranges(mask: Mask, starts: Tensor, ends: Tensor, q_offset: int, S: int) -> Tensor:
    """(nm, 4): each query block's kv_range and kv_full_range."""
    rows = []
    for q0, q1 in zip(starts.tolist(), ends.tolist(), strict=True):
        lo, hi = mask.kv_range(q0 + q_offset, q1 + q_offset, S)
        f0, f1 = mask.kv_full_range(q0 + q_offset, q1 + q_offset, S)
        rows.append((lo, hi, f0, f1))
    return torch.tensor(rows, dtype=torch.int64).view(-1, 4)


def _tiles(
    mask: Mask, grid: tuple[int, int, int, int], q_offset: int, pm: Tensor, pn: Tensor,
    block: tuple[int, int], device: torch.device,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The mask on the blocks (pm[i], pn[i]): (B | 1, H | 1, P, BM, BN) bool, False outside the
    grid, and where the grid is: (P, BM, BN)."""
    B, H, T, S = grid
    BM, BN = block
    q = q_offset + pm.to(device)[:, None] * BM + torch.arange(BM, device=device)  # (P, BM)
    k = pn.to(device)[:, None] * BN + torch.arange(BN, device=device)  # (P, BN)
    allowed = mask.predicate(
        torch.arange(B, device=device).view(B, 1, 1, 1, 1),
        torch.arange(H, device=device).view(1, H, 1, 1, 1),
        q.clamp(max=q_offset + T - 1).view(1, 1, *q.shape, 1),
        k.clamp(max=S - 1).view(1, 1, k.shape[0], 1, BN),
    )
    allowed = allowed.view((1,) * (5 - allowed.dim()) + tuple(allowed.shape))
    inside = (q < q_offset + T)[:, :, None] & (k < S)[:, None, :]
    return allowed & inside, inside


def plan_blocks(
    mask: Mask | None,
    grid: tuple[int, int, int, int],
    q_offset: int,
    block_m: int,
    block_n: int,
    device: torch.device,
) -> BlockPlan:
    """The block plan of a (B, H, T, S) call whose queries start at ``q_offset``, on ``device``."""
    T, S = grid[2:]
    nm, nn = -(-T // block_m), -(-S // block_n)
    q0 = torch.arange(nm) * block_m
    n0, n1 = torch.arange(nn) * block_n, (torch.arange(nn) * block_n + block_n).clamp(max=S)
    band = band_of(mask)
    tiles = torch.ones(1, 1, 1, block_m, block_n, dtype=torch.int8)
    if mask is None or mask.is_full:
        status = torch.full((nm, nn), FULL, dtype=torch.int64)
    else:
        r = _ranges(mask, q0, (q0 + block_m).clamp(max=T), q_offset, S)
        lo, hi, f0, f1 = (r[:, i : i + 1] for i in range(4))  # (nm, 1) each
        visit = (n1 > lo) & (n0 < hi)  # (nm, nn)
        full = visit & (n0 >= f0) & (n1 <= f1)
        status = torch.where(full, FULL, torch.where(visit, 0, FULL - 1))
        if band is None and bool((visit & ~full).any()):
            status, tiles = _partial_tiles(mask, grid, q_offset, status, (block_m, block_n), device)
    rows, cols = _compress(status), _compress(status.T.contiguous())
    return BlockPlan(
        block_m,
        block_n,
        Visits(*(t.to(device) for t in (rows.ptr, rows.inner, rows.tile))),
        Visits(*(t.to(device) for t in (cols.ptr, cols.inner, cols.tile))),
        tiles.to(device),
        band,
    )


def _partial_tiles(
    mask: Mask, grid: tuple[int, int, int, int], q_offset: int, status: Tensor,
    block: tuple[int, int], device: torch.device,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Evaluate the mask on the partial blocks (status 0): a block that allows no pair is
    skipped, one that allows every pair of the grid's is full, the rest get a tile each."""
    pm, pn = (status == 0).nonzero(as_tuple=True)
    allowed, inside = _tiles(mask, grid, q_offset, pm, pn, block, device)
    some = allowed.any(dim=(0, 1, 3, 4)).cpu()  # (P,)
    every = (allowed | ~inside).all(dim=(0, 1, 3, 4)).cpu()
    kept = some & ~every
    number = torch.full_like(pm, -1)
    number[kept] = torch.arange(int(kept.sum()))
    status = status.clone()
    status[pm, pn] = torch.where(every, FULL, torch.where(some, number, FULL - 1))
    if not bool(kept.any()):
        return status, torch.ones(1, 1, 1, *block, dtype=torch.int8, device=device)
    tiles = allowed[:, :, kept.to(device)].permute(2, 0, 1, 3, 4)  # (P, B|1, H|1, BM, BN)
    return status, tiles.to(torch.int8).contiguous()


class BlockPlanCache:
    """Least-recently-used block plans, keyed on the mask (built-in masks by their parameters
    and tensors, as :class:`~dikkat.core.flex_masks.BlockMaskCache` keys them), the grid,
    ``q_offset``, the block sizes and the device. A mask type of the caller's own is planned at
    every call: its parameters need not describe it."""

    def __init__(self, maxsize: int = 16) -> None:
        self.maxsize = maxsize
        self.builds = 0
        self.hits = 0
        self._entries: OrderedDict[tuple, tuple[Mask | None, BlockPlan]] = OrderedDict()

    def get(
        self, mask: Mask | None, grid: tuple[int, int, int, int], q_offset: int,
        block_m: int, block_n: int, device: torch.device,
    ) -> BlockPlan:  # fmt: skip
        if not is_builtin(mask):
            self.builds += 1
            return plan_blocks(mask, grid, q_offset, block_m, block_n, device)
        key = (describe(mask, tensor_identity), grid, q_offset, block_m, block_n, str(device))
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key][1]
        plan = plan_blocks(mask, grid, q_offset, block_m, block_n, device)
        self.builds += 1
        self._entries[key] = (mask, plan)  # the mask is held: see ``tensor_identity``
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every plan and reset the counters."""
        self._entries.clear()
        self.builds = self.hits = 0


block_plans = BlockPlanCache()
