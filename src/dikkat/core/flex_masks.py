"""dikkat masks as FlexAttention block masks, built once per mask and grid and kept.

Notation: ``B`` batch, ``H`` query heads, ``T``/``S`` query/key length.

A dikkat mask becomes flex's ``mask_mod`` by one shift: flex numbers the queries 0 … T − 1 while
dikkat's predicates take absolute positions, so ``mask_mod(b, h, i, j) = predicate(b, h,
i + q_offset, j)``. From it ``create_block_mask`` finds the 128 × 128 blocks with no allowed pair
(skipped) and those with every pair allowed (run unmasked). That costs a pass over the T × S grid,
so block masks are cached (:data:`block_masks`), keyed like the tiled backend's plans
(:mod:`dikkat.core.mask_keys`).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from dikkat.core.mask_keys import describe, tensor_identity
from dikkat.core.masks import Mask

__all__ = ["BlockMaskCache", "block_masks", "flex_module"]


def flex_module() -> ModuleType | None:
    """torch's FlexAttention module, or None on a torch without it (< 2.5). Imported here, not
    at the top: an optional part of torch, and a torch without it must still import dikkat."""
    try:
        return importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return None


def _mask_mod(mask: Mask, q_offset: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask.predicate(b, h, q_idx + q_offset, kv_idx)

    return mask_mod


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
            # Grid dimensions the predicate does not index stay 1 in the block mask (flex
            # broadcasts them).
            probe = mask.evaluate(
                torch.arange(B, device=device),
                torch.arange(H, device=device),
                torch.arange(q_offset, q_offset + 1, device=device),
                torch.arange(1, device=device),
            )
            Bm, Hm = (None if n == 1 else n for n in probe.shape[:2])
            mask_mod = _mask_mod(mask, q_offset)
            block_mask = flex_module().create_block_mask(mask_mod, Bm, Hm, T, S, device)  # type: ignore[union-attr]
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
