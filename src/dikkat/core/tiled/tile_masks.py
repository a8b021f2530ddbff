"""The masks of a plan's tiles, as the kernel takes them: built once per tile and kept.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``g = H / G``, ``T``/``S``
query/key length, ``n`` query blocks of a windows tile, ``W`` its window width.

The mask's predicate runs once per tile into an additive 0/−inf tensor (None where the tile
shows every pair) and the rows that see no key of it. The forward and backward passes share
them, and the plan cache (:mod:`dikkat.core.tiled.cache`) keeps them across calls, so the
predicate does not run again at every step or layer. A windows tile whose blocks all see the
same pattern over their own windows — the blocks of a sliding window, the blocks at one place in
equal packed documents — keeps one block's mask, which the kernel broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.masks import Mask
from dikkat.core.tiled.gather import stack, window_rows
from dikkat.core.tiled.plan import Rows, Windows


@dataclass(frozen=True)
class TileMask:
    """A tile's mask as the kernel takes it: ``additive`` 0 / −inf (None: every pair allowed),
    and the rows that see no key of the tile (None: every row sees one)."""

    additive: Tensor | None
    unseen: Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.additive, self.unseen) if t is not None)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where allowed, −inf where not."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def heads_view(allowed: Tensor, G: int, g: int, dims: int) -> Tensor:
    """A predicate result (…, rows, keys) of ``dims`` trailing dims, viewed against
    (B, G, g, …): head h = G-group · g + i."""
    allowed = allowed.view((1,) * (2 + dims - allowed.dim()) + tuple(allowed.shape))
    Bm, Hm = allowed.shape[0], allowed.shape[1]
    if Hm == 1:
        return allowed.view(Bm, 1, 1, *allowed.shape[2:])
    return allowed.view(Bm, G, g, *allowed.shape[2:])


def tile_allowed(
    mask: Mask | None,
    B: int,
    H: int,
    G: int,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    device: torch.device,
) -> Tensor | bool | None:
    """The tile's allowed pairs as a bool tensor viewable as (B|1, G|1, g|1, rows, keys);
    ``True`` when every pair is allowed, ``False`` when none is (skip it), None without a mask."""
    if mask is None:
        return None
    allowed = mask.evaluate(
        torch.arange(B, device=device),
        torch.arange(H, device=device),
        torch.arange(q0, q1, device=device),
        torch.arange(k0, k1, device=device),
    )
    if not bool(allowed.any()):
        return False
    if bool(allowed.all()):
        return True
    return heads_view(allowed, G, H // G, 2)


class TileMasks:
    """The masks of one plan's tiles for one mask, grid (B, H, G, T, S) and dtype, each built on
    first use and kept while the kept ones total at most ``budget`` bytes (beyond that, built at
    every use).

    A windows tile usually needs little: when every block of the tile sees the same pattern
    of its window (a sliding window's blocks past the first; in packed documents, the blocks at
    one place of equal documents) one block's mask is kept and the kernel broadcasts it."""

    def __init__(
        self,
        mask: Mask | None,
        shape: tuple[int, int, int, int, int],
        q_offset: int,
        block: int,
        dtype: torch.dtype,
        budget: int,
    ) -> None:
        self.mask, self.shape, self.q_offset = mask, shape, q_offset
        self.block, self.dtype, self.budget = block, dtype, budget
        self.kept: dict[tuple[int, int], TileMask | bool] = {}
        self.nbytes = 0

    def _keep(self, key: tuple[int, int], value: TileMask | bool) -> TileMask | bool:
        size = value.nbytes if isinstance(value, TileMask) else 0
        if self.nbytes + size <= self.budget:
            self.kept[key] = value
            self.nbytes += size
        return value

    def rows(self, i: int, item: Rows, k0: int, k1: int, device: torch.device) -> TileMask | bool:
        """Keys k0:k1 of rows item i: False when the mask hides the whole tile (skip it)."""
        if (i, k0) in self.kept:
            return self.kept[(i, k0)]
        B, H, G = self.shape[:3]
        g = H // G
        r0, r1 = item.r0 + self.q_offset, item.r1 + self.q_offset
        allowed = tile_allowed(self.mask, B, H, G, r0, r1, k0, k1, device)
        if allowed is False:
            return self._keep((i, k0), False)
        if not isinstance(allowed, Tensor):
            return self._keep((i, k0), TileMask(None, None))
        allowed = stack(allowed.expand(*allowed.shape[:2], g, r1 - r0, k1 - k0))
        seen = allowed.any(-1)
        unseen = None if bool(seen.all()) else ~seen
        return self._keep((i, k0), TileMask(_additive(allowed, self.dtype), unseen))

    def windows(self, i: int, item: Windows, device: torch.device) -> TileMask:
        """Windows item i's mask, laid out like :func:`to_kernel`'s scores: additive
        (1 | B·G, n | 1, g·block, W), unseen (B|1, G|1, n|1, g·block)."""
        if (i, 0) in self.kept:
            return self.kept[(i, 0)]  # type: ignore[return-value]
        assert self.mask is not None
        B, H, G, T, S = self.shape
        g, block, n, W = H // G, self.block, item.starts.numel(), item.width
        rows = window_rows(item, block, T)[0].to(device)
        index = item.starts.to(device)[:, None] + torch.arange(W, device=device)  # (n, W)
        allowed = self.mask.predicate(
            torch.arange(B, device=device).view(B, 1, 1, 1, 1),
            torch.arange(H, device=device).view(1, H, 1, 1, 1),
            (self.q_offset + rows).view(n, block, 1),
            index.clamp(max=S - 1).view(n, 1, W),
        )
        allowed = heads_view(
            allowed & (index < S).view(n, 1, W), G, g, 3
        )  # (B|1, G|1, g|1, n, ·, W)
        Bm, Gm = allowed.shape[:2]
        a = allowed.expand(Bm, Gm, g, n, block, W).transpose(2, 3).reshape(Bm, Gm, n, -1, W)
        if n > 1 and bool((a == a[:, :, :1]).all()):
            a = a[:, :, :1]  # one pattern for every block: kept once, broadcast by the kernel
        seen = a.any(-1)
        unseen = None if bool(seen.all()) else ~seen
        if bool(a.all()):
            return self._keep((i, 0), TileMask(None, unseen))  # type: ignore[return-value]
        if Bm * Gm > 1:
            a = a.expand(B, G, *a.shape[2:]).reshape(B * G, *a.shape[2:])
        else:
            a = a.reshape(1, *a.shape[2:])
        return self._keep((i, 0), TileMask(_additive(a, self.dtype), unseen))  # type: ignore[return-value]
