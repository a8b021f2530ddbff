"""The plan cache: the last few plans with their tile masks, so that a repeated call — every step
of a training run, every layer of a model — plans and evaluates its mask once.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length.

Entries are keyed on the mask (built-in masks only, by their parameters and tensors:
:func:`dikkat.core.mask_keys.describe`), the grid, the tiling, the dtype and the device. A mask
type of the caller's own may change under the cache: its plan is built at every call.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dikkat.core import tuning
from dikkat.core.mask_keys import describe, is_builtin, tensor_identity
from dikkat.core.masks import Mask
from dikkat.core.tiled.plan import Plan, Windows, choose_block, make_plan
from dikkat.core.tiled.tile_masks import TileMasks

# Tile masks one plan keeps (beyond: rebuilt at each use). A memory budget, not a measurement:
# a sliding window keeps one block's mask per tile, 1 MiB in all at n = 16384 in fp32.
KEPT_MASK_BYTES = 32 << 20


@dataclass(frozen=True)
class Prepared:
    """A plan, its tile masks and its block size: what one call runs."""

    plan: Plan
    masks: TileMasks
    block: int

    @functools.cached_property
    def covers(self) -> bool:
        """Whether the plan's tiles write every query row: windows for every block (a plan of
        rows may skip all key tiles of some rows)."""
        T = self.masks.shape[3]
        windows = [item for item in self.plan if isinstance(item, Windows)]
        blocks = sum(item.blocks.numel() for item in windows)
        return len(windows) == len(self.plan) and blocks == -(-T // self.block)


class PlanCache:
    """Least-recently-used plans with their tile masks; each plan keeps at most
    ``kept_mask_bytes`` of tile masks. ``builds`` counts plans built (misses, and every call
    with a mask of the caller's own), ``hits`` plans reused."""

    def __init__(self, maxsize: int = 8, kept_mask_bytes: int = KEPT_MASK_BYTES) -> None:
        for name, value in (("maxsize", maxsize), ("kept_mask_bytes", kept_mask_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.maxsize = maxsize
        self.kept_mask_bytes = kept_mask_bytes
        self.builds = 0
        self.hits = 0
        self._entries: OrderedDict[tuple, tuple[Mask | None, Prepared]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple | None, mask: Mask | None, build: Callable[[], Prepared]) -> Prepared:
        """The entry of ``key``, or ``build()`` kept under it (``key`` None: built, not kept)."""
        if key is not None and key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key][1]
        prepared = build()
        self.builds += 1
        if key is not None and self.maxsize > 0:
            self._entries[key] = (mask, prepared)  # the mask is held: its tensors' ids stay
            if len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return prepared

    def clear(self) -> None:
        """Drop every plan and its tile masks, and reset the counters."""
        self._entries.clear()
        self.builds = self.hits = 0


plans = PlanCache()  # the one tiled_attention uses unless it is given another


def prepare(
    mask: Mask | None,
    shape: tuple[int, int, int, int, int],
    q_offset: int,
    block: int | None,
    cells: int,
    key_tile: int,
    windows: bool | None,
    dtype: torch.dtype,
    device: torch.device,
    cache: PlanCache,
) -> Prepared:
    """The plan of a (B, H, G, T, S) call and its tile masks, from ``cache`` when it has them;
    ``block`` None: the size :func:`~dikkat.core.tiled.plan.choose_block` finds, with the
    device's kernel speeds (:func:`dikkat.core.tuning.for_device`)."""
    B, H, _, T, S = shape

    def build() -> Prepared:
        speed = tuning.for_device(device).rows_speed
        size = block or choose_block(mask, B * H, T, S, q_offset, cells, key_tile, windows, speed)
        plan = make_plan(mask, (B, H, T, S), q_offset, size, cells, key_tile, windows)
        masks = TileMasks(mask, shape, q_offset, size, dtype, cache.kept_mask_bytes)
        return Prepared(plan, masks, size)

    if not is_builtin(mask):  # a mask of the caller's own may change under us
        return cache.get(None, mask, build)
    description = describe(mask, tensor_identity)
    key = (description, shape, q_offset, block, cells, key_tile, windows, dtype, str(device))
    return cache.get(key, mask, build)
