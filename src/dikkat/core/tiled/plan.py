"""The plan of a tiled call: its work cut into tiles of query rows or of key windows.

Notation: ``B`` batch, ``H`` query heads, ``T``/``S`` query/key length, ``W`` window width.

The queries are cut into blocks of ``block`` rows, and the mask's ``kv_range`` bounds the keys
each block can see. A plan groups the work into tiles of at most ``cells`` score cells (summed
over batch and heads), in one of two shapes:

- :class:`Rows` — a run of query rows against a shared key range, cut into key tiles of at most
  ``key_tile`` keys (no mask, causal, prefix-LM, padding).
- :class:`Windows` — when the blocks' key ranges slide (a sliding window, packed documents),
  each block gets its own window of ``W`` keys starting where its range starts; blocks are
  grouped by width, so that the short windows at the start of each packed document are not
  padded to the longest.

A plan is all rows or all windows. For windows the block size is chosen by :func:`choose_block`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.masks import Mask

# Design bounds, not measurements (the machine-measured numbers are in dikkat.core.tuning):
BLOCK = 128  # query rows per block: the unit of key-range bounds and of windows (flex's too)
KEY_TILE = 4096  # keys per tile in a run of rows; beyond it the online softmax carries over
CELLS = 1 << 22  # score cells per tile, over batch and heads: 16 MiB of fp32 scores


@dataclass(frozen=True)
class Rows:
    """Query rows r0:r1 against keys k0:k1, in key tiles of ``key_tile``; keys f0:f1 are seen by
    every one of the rows (:meth:`~dikkat.core.masks.Mask.kv_full_range`), so their tiles run
    without a mask and the tiles are cut where that part starts and ends."""

    r0: int
    r1: int
    k0: int
    k1: int
    f0: int = 0
    f1: int = 0

    def key_tiles(self, key_tile: int) -> list[tuple[int, int, bool]]:
        """(k0, k1, seen by every row) of each key tile, at most ``key_tile`` keys each."""
        f0, f1 = max(self.k0, self.f0), min(self.k1, self.f1)
        parts = [(self.k0, self.k1, False)] if f0 >= f1 else [
            (self.k0, f0, False), (f0, f1, True), (f1, self.k1, False)
        ]  # fmt: skip
        return [
            (k0, min(k0 + key_tile, b), full)
            for a, b, full in parts
            for k0 in range(a, b, key_tile)
        ]


@dataclass(frozen=True)
class Windows:
    """Query blocks ``blocks`` (of ``block`` rows each); block i sees keys starts[i] … starts[i]
    + W − 1. The blocks need not be adjacent: the plan groups blocks of about the same width."""

    blocks: Tensor  # (n,) block numbers: rows blocks[i]·block … (blocks[i] + 1)·block − 1
    starts: Tensor  # (n,)
    width: int


Plan = list[Rows | Windows]


def make_plan(
    mask: Mask | None,
    shape: tuple[int, int, int, int],
    q_offset: int,
    block: int,
    cells: int,
    key_tile: int,
    windows: bool | None,
) -> Plan:
    """Cut the (B, H, T, S) work into tiles; ``windows`` forces (True) or forbids (False) the
    window shape, None lets the key ranges decide."""
    B, H, T, S = shape
    if B * H * T * S == 0:
        return []
    starts = list(range(0, T, block))
    ranges = [
        (0, S) if mask is None else mask.kv_range(q0 + q_offset, min(q0 + block, T) + q_offset, S)
        for q0 in starts
    ]
    widths = [max(0, hi - lo) for lo, hi in ranges]
    sliding = len({lo for lo, _ in ranges}) > 1 and max(widths) <= key_tile
    if windows is None:  # worth it when the windows cover at most half the score matrix
        windows = mask is not None and sliding and sum(widths) * block * 2 <= T * S
    if windows and mask is not None and max(widths) > 0:
        return _windows_plan(ranges, widths, B * H, block, cells)
    rows = cells // (B * H * min(S, key_tile))
    rows = max(1, (rows // block) * block if rows >= block else rows)
    plan: Plan = []
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        if mask is None:
            plan.append(Rows(r0, r1, 0, S, 0, S))
            continue
        lo, hi = mask.kv_range(r0 + q_offset, r1 + q_offset, S)
        f0, f1 = mask.kv_full_range(r0 + q_offset, r1 + q_offset, S)
        plan.append(Rows(r0, r1, lo, max(lo, hi), f0, f1))
    return plan


def _windows_plan(
    ranges: list[tuple[int, int]], widths: list[int], heads: int, block: int, cells: int
) -> Plan:
    """Blocks grouped by their window width rounded up to a multiple of ``block`` (inside the
    documents of a packed batch the widths grow from one block to a whole document: one width
    for all would compute about twice the cells), then cut to fit ``cells``."""
    by_width: dict[int, list[int]] = {}
    for i, w in enumerate(widths):
        if w > 0:  # a block that sees no key keeps output 0 and lse −inf
            by_width.setdefault(-(-w // block) * block, []).append(i)
    plan: Plan = []
    for width, blocks in sorted(by_width.items()):
        per = max(1, cells // (heads * block * width))  # blocks per tile
        for i in range(0, len(blocks), per):
            chosen = blocks[i : i + per]
            plan.append(
                Windows(torch.tensor(chosen), torch.tensor([ranges[b][0] for b in chosen]), width)
            )
    return plan


def windows_cells(plan: Plan, block: int) -> int:
    """Score cells per batch entry and head that a plan of windows computes."""
    return sum(item.starts.numel() * block * item.width for item in plan)  # type: ignore[union-attr]


def choose_block(
    mask: Mask | None,
    heads: int,
    T: int,
    S: int,
    q_offset: int,
    cells: int,
    key_tile: int,
    windows: bool | None,
    rows_speed: Mapping[int, float],
) -> int:
    """The block size for a windows plan: of the sizes in ``rows_speed`` (the tile kernel's
    speed by rows per block, :mod:`dikkat.core.tuning`), the one with the least cells to compute
    weighted by that speed. A window of w keys costs each block of b rows b·(w + b) cells: a
    narrow band computes fewer cells with small blocks (w = 256: 64 rows compute 17 % fewer
    than 128), packed documents pay few extra cells for large ones (1024 tokens: 256 rows
    compute 11 % more) and gain the kernel's speed. Plans of rows keep :data:`BLOCK`."""
    if mask is None or windows is False:
        return BLOCK

    def cost(block: int) -> float | None:
        plan = make_plan(mask, (1, heads, T, S), q_offset, block, cells, key_tile, windows)
        if not plan or not all(isinstance(item, Windows) for item in plan):
            return None
        return windows_cells(plan, block) / rows_speed[block]

    costs = {block: cost(block) for block in rows_speed}
    if costs.get(BLOCK) is None:  # not a windows plan
        return BLOCK
    return min((c, block) for block, c in costs.items() if c is not None)[1]
