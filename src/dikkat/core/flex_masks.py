"""dikkat masks as FlexAttention block masks, built once per mask and grid and kept.

Notation: ``B`` batch, ``H`` query heads, ``T``/``S`` query/key length.

A dikkat mask becomes flex's ``mask_mod`` by one shift: flex numbers the queries 0 … T − 1 while
dikkat's predicates take absolute positions, so ``mask_mod(b, h, i, j) = predicate(b, h,
i + q_offset, j)``. From it ``create_block_mask`` finds the 128 × 128 blocks with no allowed pair
(skipped) and those with every pair allowed (run unmasked). That costs a pass over the T × S grid,
so block masks are cached (:data:`block_masks`), keyed like the tiled backend's plans
(:mod:`dikkat.core.mask_keys`). Inside ``torch.compile`` or ``torch.export`` no cache is read:
:func:`build_block_mask` runs in the trace, where dynamo follows ``create_block_mask`` into the
graph (a Python dict keyed on tensor identities is not something a graph can hold).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from dikkat.core.mask_keys import describe, tensor_identity
from dikkat.core.masks import Mask

__all__ = ["BlockMaskCache", "block_masks", "build_block_mask", "flex_module"]

# Imported once, here: dynamo cannot follow importlib inside a compiled region (a graph break),
# while a module-level reference it reads as a constant. A torch without flex (< 2.5) must still
# import dikkat.
_FLEX: ModuleType | None
try:
    from torch.nn.attention import flex_attention as _FLEX
except ImportError:  # pragma: no cover
    _FLEX = None


def flex_module() -> ModuleType | None:
    """torch's FlexAttention module, or None on a torch without it (< 2.5)."""
    return _FLEX


def _mask_mod(mask: Mask, q_offset: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask.predicate(b, h, q_idx + q_offset, kv_idx)

    return mask_mod


def build_block_mask(
    mask: Mask, B: int, H: int, T: int, S: int, q_offset: int, device: torch.device
) -> object:
    """flex's ``BlockMask`` for ``mask`` on the (B, H, T, S) grid, queries from ``q_offset``;
    uncached (inside a trace this is what runs: it reads shapes only, never values)."""
    # Grid dimensions the predicate does not index stay 1 in the block mask (flex broadcasts
    # them): a probe of one query and one key tells which those are, from its shape alone.
    probe = mask.evaluate(
        torch.arange(B, device=device),
        torch.arange(H, device=device),
        torch.arange(q_offset, q_offset + 1, device=device),
        torch.arange(1, device=device),
    )
    Bm, Hm = (None if n == 1 else n for n in probe.shape[:2])
    return _FLEX.create_block_mask(_mask_mod(mask, q_offset), Bm, Hm, T, S, device)  # type: ignore[union-attr]


class BlockMaskCache:
    """Least-recently-used flex ``BlockMask``s, keyed on the mask (built-in masks by their
    parameters and tensors, others by identity), the grid (B, H, T, S), ``q_offset`` and device.

    A cached block mask is reused only for a mask that allows exactly the same pairs: equal
    parameters, the very same tensors, unchanged since (their in-place version is in the key).
    """

    def __init__(self, maxsize: int = 16) -> None:
        self.maxsize = maxsize
        self.builds = 0  # block masks built (cache misses)
        self.hits = 0
        self._entries: OrderedDict[tuple, tuple[Mask, object]] = OrderedDict()

    def get(
        self, mask: Mask, B: int, H: int, T: int, S: int, q_offset: int, device: torch.device
    ) -> object:
        key = (describe(mask, tensor_identity), B, H, T, S, q_offset, torch.device(device))
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key][1]
        try:
            block_mask = build_block_mask(mask, B, H, T, S, q_offset, device)
        except Exception as e:  # a predicate of the caller's own that torch.vmap cannot run
            raise ValueError(
                f"flex cannot build a block mask from {type(mask).__name__}: its predicate must "
                f"run under torch.vmap on 0-d index tensors ({type(e).__name__}: {e})"
            ) from e
        self.builds += 1
        self._entries[key] = (mask, block_mask)  # the mask is held: see ``tensor_identity``
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return block_mask

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every block mask and reset the counters."""
        self._entries.clear()
        self.builds = self.hits = 0


block_masks = BlockMaskCache()
