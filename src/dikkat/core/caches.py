"""Every cache dikkat keeps, and one call that empties them all.

Notation: ``B`` batch, ``H`` query heads, ``T``/``S`` query/key length.

- :data:`dikkat.core.tiled.plans` — the tiled backend's plans and tile masks, per mask and grid.
- :data:`dikkat.core.flex.block_masks` — flex's block masks, per mask and (B, H, T, S).
- :data:`dikkat.core.triton.block_plans` — the triton backend's block plans and mask tiles, per
  mask, grid and block size.
- :data:`dikkat.core.flex.compiled` — the signatures this process has compiled flex for, which
  ``auto`` reads (the compiled graphs themselves are torch's, in its dynamo cache: never reset
  here, since that would drop every graph compiled in the process).

Each holds a bounded number of entries and keeps the masks it was built from, so an entry is
never reused for another mask. Clearing them changes no result: the next call rebuilds what it
needs (and ``auto`` passes flex by until a call with ``backend="flex"`` compiles it again).
"""

from __future__ import annotations

from dikkat.core import flex, tiled
from dikkat.core import triton as triton_backend

__all__ = ["cache_sizes", "clear_caches"]


def clear_caches() -> None:
    """Empty every cache dikkat keeps (see the module docstring) and reset their counters."""
    tiled.plans.clear()
    flex.block_masks.clear()
    flex.compiled.clear()
    triton_backend.block_plans.clear()


def cache_sizes() -> dict[str, int]:
    """Entries in each cache: ``{"tiled plans": …, "flex block masks": …, "flex compiled
    signatures": …, "triton block plans": …}``."""
    return {
        "tiled plans": len(tiled.plans),
        "flex block masks": len(flex.block_masks),
        "flex compiled signatures": len(flex.compiled),
        "triton block plans": len(triton_backend.block_plans),
    }
