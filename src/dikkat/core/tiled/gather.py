"""Moving a tile's rows between the heads' layout and the kernel's: stacking the query heads of
a key/value head, and gathering a windows tile (its query blocks and their key windows).

Notation: ``B`` batch, ``G`` key/value heads, ``g`` query heads per key/value head (``H = G·g``),
``T``/``S`` query/key length, ``D``/``Dv`` head dims, ``R`` rows of a tile, ``n`` query blocks of
a windows tile, ``W`` its window width.

A windows tile goes to the kernel as one call for every batch entry and kv head: batch × kv
heads as the kernel's batch, the blocks as its heads, the g query heads of a kv head stacked as
its rows. When the blocks (or the window starts) step evenly, their rows and windows are strided
views of q, k, v and the output — overlapping, never copied; otherwise they are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.tiled.plan import Windows


def stack(x: Tensor) -> Tensor:
    """(B, G, g, R, ·) → (B, G, g·R, ·): the g query heads that share a kv head, their rows
    stacked, so one call shares each key tile among them without repeating k and v."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def unstack(x: Tensor, g: int) -> Tensor:
    """(B, G, g·R, ·) → (B, G, g, R, ·)."""
    return x.reshape(x.shape[0], x.shape[1], g, x.shape[2] // g, *x.shape[3:])


def window_rows(item: Windows, block: int, T: int) -> tuple[Tensor, Tensor, tuple[int, int] | None]:
    """The query rows of a windows item: (rows clamped into 0 … T − 1, which are real — the
    last block may run past T —, and (first row, row step) when the blocks step evenly and none
    is padded, so that a strided view reaches them; else None)."""
    rows = (item.blocks[:, None] * block + torch.arange(block)).flatten()
    real = rows < T
    n = item.blocks.numel()
    b0 = int(item.blocks[0])
    step = int(item.blocks[1]) - b0 if n > 1 else 1
    even = step > 0 and bool((item.blocks == b0 + step * torch.arange(n)).all())
    view = (b0 * block, step * block) if even and bool(real.all()) else None
    return rows.clamp(max=T - 1), real, view


@dataclass
class Gathered:
    """One windows tile in the kernel's layout (see :func:`to_kernel`), and where its rows go
    back."""

    q: Tensor  # (B·G, n, g·block, D)
    k: Tensor  # (B·G, n, W, D)
    v: Tensor  # (B·G, n, W, Dv)
    index: Tensor  # (n, W) key of every window slot, clamped into 0 … S − 1 (slots past S masked)
    rows: Tensor  # (n·block,) query row of each gathered row, clamped into 0 … T − 1
    real: Tensor  # (n·block,) False for the rows past T that pad the last block
    view: tuple[int, int] | None  # (first row, row step) when a strided view reaches the rows
    block: int

    def _blocks(self, x: Tensor) -> Tensor:
        """The rows of (B, G, g, T, ·) as a strided view (B, G, g, n, block, ·)."""
        first, step = self.view  # type: ignore[misc]
        sB, sG, sg, sT, sC = x.stride()
        n = self.rows.numel() // self.block
        return x.as_strided(
            (*x.shape[:3], n, self.block, x.shape[4]),
            (sB, sG, sg, step * sT, sT, sC),
            x.storage_offset() + first * sT,
        )

    def take(self, x: Tensor) -> Tensor:
        """(B, G, g, T, ·) → these rows, (B, G, g, n, block, ·): a view when one reaches them."""
        if self.view is not None:
            return self._blocks(x)
        n = self.rows.numel() // self.block
        return x[:, :, :, self.rows].unflatten(3, (n, self.block))

    def scatter(self, dst: Tensor, src: Tensor) -> None:
        """The real rows of src (B, G, g, n, block, ·) into their places in dst (B, G, g, T, ·)."""
        if self.view is not None:
            self._blocks(dst).copy_(src)
            return
        src = src.flatten(3, 4)
        if not bool(self.real.all()):
            dst.index_copy_(3, self.rows[self.real], src[:, :, :, self.real])
        else:
            dst.index_copy_(3, self.rows, src)


def windows_of(x: Tensor, starts: Tensor, W: int) -> Tensor:
    """(B, G, S, ·) → (B, G, n, W, ·): rows starts[i] … starts[i] + W − 1 (clamped to S − 1).

    When the starts step evenly and every window fits (a sliding window; one position inside
    each of a run of equal documents) the windows are a strided view of x: overlapping, never
    copied. Otherwise they are gathered."""
    S = x.shape[2]
    n = starts.numel()
    first, last = int(starts[0]), int(starts[-1])
    step = (last - first) // (n - 1) if n > 1 else 0
    even = n == 1 or bool((starts == first + step * torch.arange(n)).all())
    if even and step >= 0 and last + W <= S and x.stride(3) == 1:
        B, G, _, C = x.shape
        sB, sG, sS, _ = x.stride()
        return x.as_strided(
            (B, G, n, W, C), (sB, sG, step * sS, sS, 1), x.storage_offset() + first * sS
        )
    index = (starts[:, None] + torch.arange(W)).clamp(max=S - 1).to(x.device)
    return x[:, :, index]


def to_kernel(x: Tensor) -> Tensor:
    """(B, G, g, n, block, ·) rows of a windows tile → (B·G, n, g·block, ·): batch and kv heads
    folded into the kernel's batch, the blocks as its heads, the g query heads of a kv head
    stacked (a view when g = 1 and the strides allow)."""
    B, G, g, n, block, C = x.shape
    return x.transpose(2, 3).reshape(B * G, n, g * block, C)


def from_kernel(x: Tensor, B: int, G: int, g: int) -> Tensor:
    """(B·G, n, g·block, ·) → (B, G, g, n, block, ·): back to the heads' own order."""
    n, C = x.shape[1], x.shape[-1]
    return x.view(B, G, n, g, -1, C).transpose(2, 3)


def gather(item: Windows, q: Tensor, k: Tensor, v: Tensor, block: int) -> Gathered:
    """q (B, G, g, T, D), k and v (B, G, S, ·) → the tile in the kernel's layout."""
    T, S = q.shape[3], k.shape[2]
    W = item.width
    rows, real, view = window_rows(item, block, T)
    index = (item.starts[:, None] + torch.arange(W)).clamp(max=S - 1).to(q.device)
    t = Gathered(q, k, v, index, rows.to(q.device), real.to(q.device), view, block)
    t.q = to_kernel(t.take(q))
    # batch and kv heads fold into one dim: a view of (B, G, n, W, ·) when k and v are laid out
    # (B, G, S, ·) — tiled_attention makes them so once per call when B > 1
    t.k = windows_of(k, item.starts, W).flatten(0, 1)
    t.v = windows_of(v, item.starts, W).flatten(0, 1)
    return t
