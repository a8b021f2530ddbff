"""Exact attention over tiles with the online softmax: the T×S score matrix never exists (S16).

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (``g = H / G`` query heads per
key/value head), ``T``/``S`` query/key length, ``D``/``Dv`` head dims, ``W`` window width.

The queries are cut into blocks of ``block`` rows, and the mask's ``kv_range`` bounds the keys
each block can see. A *plan* then groups the work into tiles of at most ``cells`` score cells
(summed over batch and heads), in one of two shapes:

- **rows** — a run of query rows against a shared key range, cut into key tiles of at most
  ``key_tile`` keys. Across key tiles the online softmax carries per row the running maximum
  ``m``, the running sum ``l`` of exp(score − m) and the weighted sum of values, rescaling them
  by exp(m_old − m_new) when the maximum grows; ``out = acc / l`` and ``lse = m + log l``.
  A key tile the mask hides entirely is skipped; one it shows entirely needs no masking. No
  mask, causal, prefix-LM and padding run this way (causal skips about half the work).
- **windows** — when the blocks' key ranges slide (a sliding window, packed documents), each
  block gets its own window of ``W`` keys starting where its range starts; the windows of many
  blocks, for every batch entry and head, go to the kernel in one call (blocks as its heads,
  batch × kv heads as its batch), so a band of width w costs O(T·w) in a handful of calls
  instead of a Python loop over tiles. Blocks are
  grouped by width, so that the short windows at the start of each packed document are not
  padded to the longest.

The mask is evaluated once per tile into an additive 0/−inf tensor, and kept: the forward and
backward passes share it, and a small cache keyed on the mask's parameters (built-in masks only)
keeps the plan and its tile masks across calls, as flex keeps its block masks, so the predicate
does not run again at every step or layer. A windows tile whose blocks all see the same pattern
over their own windows — the blocks of a sliding window, the blocks at one place in equal packed
documents — keeps one block's mask, which the kernel broadcasts.

Each tile — softmax(q kᵀ·scale + mask) v over its rows and keys, with the tile's log-sum-exp —
runs on CPU in PyTorch's fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``,
given the tile's mask as an additive 0/−inf tensor), elsewhere in plain tensor ops; dikkat does
the planning, the skipping, the gathering and the merging across key tiles.

Extra memory is O((T + S)·D + cells), never O(T·S), plus the kept tile masks: at most
``KEPT_MASK_BYTES`` per plan, for the few plans the cache holds (a sliding window keeps one
block's mask per tile: 1 MiB in all at n = 16384, fp32). The backward pass is a custom autograd
function that recomputes each tile's weights from the saved log-sum-exp, following the same
plan, so training memory is O(n) too.

What differs from the reference: the sum runs in a different order (so results differ by
rounding), matmuls run in the input dtype but the softmax statistics and accumulators in fp32
(fp64 for fp64 inputs), and there is no dropout. Rows with every key masked give output 0 and
``lse = −inf``; a call with no score cells (B, T or S = 0) gives zeros. A bias is added in fp32
(fp64 for fp64 inputs), and it is differentiable: a tile whose bias needs a gradient runs the
plain-ops backward of :mod:`dikkat.core.tiled_grad`, which also gives the scores' gradient.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.masks import Mask, describe, is_builtin, tensor_identity
from dikkat.core.tiled_grad import acc_dtype as _acc_dtype
from dikkat.core.tiled_grad import add_bias_grad, plain_tile_backward

BLOCK = 128  # query rows per block: the unit of key-range bounds and of windows
KEY_TILE = 4096  # keys per tile in a run of rows; beyond it the online softmax carries over
CELLS = 1 << 22  # score cells per tile, over batch and heads: 16 MiB of fp32 scores
FUSED_TILES = True  # run each tile in PyTorch's fused CPU flash kernel where there is one
KEPT_MASK_BYTES = 32 << 20  # tile masks kept per plan (beyond: rebuilt at each use)


@dataclass(frozen=True)
class _Rows:
    """Query rows r0:r1 against keys k0:k1, in key tiles of ``key_tile``."""

    r0: int
    r1: int
    k0: int
    k1: int


@dataclass(frozen=True)
class _Windows:
    """Query blocks ``blocks`` (of ``block`` rows each); block i sees keys starts[i] … starts[i]
    + W − 1. The blocks need not be adjacent: the plan groups blocks of about the same width."""

    blocks: Tensor  # (n,) block numbers: rows blocks[i]·block … (blocks[i] + 1)·block − 1
    starts: Tensor  # (n,)
    width: int


def _plan(
    mask: Mask | None,
    shape: tuple[int, int, int, int],
    q_offset: int,
    block: int,
    cells: int,
    key_tile: int,
    windows: bool | None,
) -> list[_Rows | _Windows]:
    """Cut the work into tiles; ``windows`` forces (True) or forbids (False) the window shape,
    None lets the key ranges decide."""
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
    plan: list[_Rows | _Windows] = []
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        lo, hi = (0, S) if mask is None else mask.kv_range(r0 + q_offset, r1 + q_offset, S)
        plan.append(_Rows(r0, r1, lo, max(lo, hi)))
    return plan


def _windows_plan(
    ranges: list[tuple[int, int]], widths: list[int], heads: int, block: int, cells: int
) -> list[_Rows | _Windows]:
    """Blocks grouped by their window width rounded up to a multiple of ``block`` (inside the
    documents of a packed batch the widths grow from one block to a whole document: one width
    for all would compute about twice the cells), then cut to fit ``cells``."""
    by_width: dict[int, list[int]] = {}
    for i, w in enumerate(widths):
        if w > 0:  # a block that sees no key keeps output 0 and lse −inf
            by_width.setdefault(-(-w // block) * block, []).append(i)
    plan: list[_Rows | _Windows] = []
    for width, blocks in sorted(by_width.items()):
        per = max(1, cells // (heads * block * width))  # blocks per tile
        for i in range(0, len(blocks), per):
            chosen = blocks[i : i + per]
            plan.append(
                _Windows(torch.tensor(chosen), torch.tensor([ranges[b][0] for b in chosen]), width)
            )
    return plan


def _key_tiles(item: _Rows, key_tile: int) -> range:
    return range(item.k0, item.k1, key_tile)


def _heads(allowed: Tensor, G: int, g: int, dims: int) -> Tensor:
    """A predicate result (…, rows, keys) of ``dims`` trailing dims, viewed against
    (B, G, g, …): head h = G-group · g + i."""
    allowed = allowed.view((1,) * (2 + dims - allowed.dim()) + tuple(allowed.shape))
    Bm, Hm = allowed.shape[0], allowed.shape[1]
    if Hm == 1:
        return allowed.view(Bm, 1, 1, *allowed.shape[2:])
    return allowed.view(Bm, G, g, *allowed.shape[2:])


def _tile_mask(
    mask: Mask | None, B: int, H: int, G: int, q0: int, q1: int, k0: int, k1: int, device
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
    return _heads(allowed, G, H // G, 2)


def _bias_tile(bias: Tensor | None, G: int, q0: int, q1: int, k0: int, k1: int) -> Tensor | None:
    """The bias entries of one tile, viewable against (B, G, g, rows, keys)."""
    if bias is None:
        return None
    rows = slice(q0, q1) if bias.shape[2] > 1 else slice(None)
    cols = slice(k0, k1) if bias.shape[3] > 1 else slice(None)
    t = bias[:, :, rows, cols]
    Bb, Hb = t.shape[0], t.shape[1]
    return t.view(Bb, 1, 1, *t.shape[2:]) if Hb == 1 else t.reshape(Bb, G, Hb // G, *t.shape[2:])


# --- masks of the tiles, built once and kept -----------------------------------------------------


@dataclass(frozen=True)
class _TileMask:
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


def _with_bias(additive: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """The tile's mask plus its bias, in the bias's dtype (fp32 for bf16 q: the CPU kernel
    takes a wider float mask and adds it in fp32)."""
    if bias is None:
        return additive
    return bias if additive is None else additive + bias


def _stack(x: Tensor) -> Tensor:
    """(B, G, g, R, ·) → (B, G, g·R, ·): the g query heads that share a kv head, their rows
    stacked, so one call shares each key tile among them without repeating k and v."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _unstack(x: Tensor, g: int) -> Tensor:
    """(B, G, g·R, ·) → (B, G, g, R, ·)."""
    return x.reshape(x.shape[0], x.shape[1], g, x.shape[2] // g, *x.shape[3:])


def _window_rows(item: _Windows, block: int, T: int) -> tuple[Tensor, Tensor, tuple | None]:
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


class _TileMasks:
    """The masks of one plan's tiles for one mask, grid and dtype, each built on first use and
    kept while the kept ones total at most :data:`KEPT_MASK_BYTES` (beyond that, built at every
    use). Forward and backward share them, and :data:`_prepared` keeps them across calls — the
    predicate runs once, not at every call.

    A windows tile usually needs little: when every block of the tile sees the same pattern
    of its window (a sliding window's blocks past the first; in packed documents, the blocks at
    one place of equal documents) one block's mask is kept and the kernel broadcasts it."""

    def __init__(self, mask: Mask | None, shape: tuple[int, ...], q_offset: int, block: int, dtype):
        self.mask, self.shape, self.q_offset = mask, shape, q_offset
        self.block, self.dtype = block, dtype
        self.kept: dict[tuple[int, int], _TileMask | bool] = {}
        self.nbytes = 0

    def _keep(self, key: tuple[int, int], value: _TileMask | bool) -> _TileMask | bool:
        size = value.nbytes if isinstance(value, _TileMask) else 0
        if self.nbytes + size <= KEPT_MASK_BYTES:
            self.kept[key] = value
            self.nbytes += size
        return value

    def rows(self, i: int, item: _Rows, k0: int, k1: int, device) -> _TileMask | bool:
        """Keys k0:k1 of rows item i: False when the mask hides the whole tile (skip it)."""
        if (i, k0) in self.kept:
            return self.kept[(i, k0)]
        B, H, G = self.shape[:3]
        g = H // G
        r0, r1 = item.r0 + self.q_offset, item.r1 + self.q_offset
        allowed = _tile_mask(self.mask, B, H, G, r0, r1, k0, k1, device)
        if allowed is False:
            return self._keep((i, k0), False)
        if not isinstance(allowed, Tensor):
            return self._keep((i, k0), _TileMask(None, None))
        allowed = _stack(allowed.expand(*allowed.shape[:2], g, r1 - r0, k1 - k0))
        seen = allowed.any(-1)
        unseen = None if bool(seen.all()) else ~seen
        return self._keep((i, k0), _TileMask(_additive(allowed, self.dtype), unseen))

    def windows(self, i: int, item: _Windows, device) -> _TileMask:
        """Windows item i's mask, laid out like :func:`_to_kernel`'s scores: additive
        (1 | B·G, n | 1, g·block, W), unseen (B|1, G|1, n|1, g·block)."""
        if (i, 0) in self.kept:
            return self.kept[(i, 0)]  # type: ignore[return-value]
        assert self.mask is not None
        B, H, G, T, S = self.shape
        g, block, n, W = H // G, self.block, item.starts.numel(), item.width
        rows = _window_rows(item, block, T)[0].to(device)
        index = item.starts.to(device)[:, None] + torch.arange(W, device=device)  # (n, W)
        allowed = self.mask.predicate(
            torch.arange(B, device=device).view(B, 1, 1, 1, 1),
            torch.arange(H, device=device).view(1, H, 1, 1, 1),
            (self.q_offset + rows).view(n, block, 1),
            index.clamp(max=S - 1).view(n, 1, W),
        )
        allowed = _heads(allowed & (index < S).view(n, 1, W), G, g, 3)  # (B|1, G|1, g|1, n, ·, W)
        Bm, Gm = allowed.shape[:2]
        a = allowed.expand(Bm, Gm, g, n, block, W).transpose(2, 3).reshape(Bm, Gm, n, -1, W)
        if n > 1 and bool((a == a[:, :, :1]).all()):
            a = a[:, :, :1]  # one pattern for every block: kept once, broadcast by the kernel
        seen = a.any(-1)
        unseen = None if bool(seen.all()) else ~seen
        if bool(a.all()):
            return self._keep((i, 0), _TileMask(None, unseen))  # type: ignore[return-value]
        if Bm * Gm > 1:
            a = a.expand(B, G, *a.shape[2:]).reshape(B * G, *a.shape[2:])
        else:
            a = a.reshape(1, *a.shape[2:])
        return self._keep((i, 0), _TileMask(_additive(a, self.dtype), unseen))  # type: ignore[return-value]


@dataclass(frozen=True)
class _Prepared:
    plan: list[_Rows | _Windows]
    masks: _TileMasks
    block: int

    @functools.cached_property
    def covers(self) -> bool:
        """Whether the plan's tiles write every query row: windows for every block (a plan of
        rows may skip all key tiles of some rows)."""
        T = self.masks.shape[3]
        windows = [item for item in self.plan if isinstance(item, _Windows)]
        return len(windows) == len(self.plan) and sum(item.blocks.numel() for item in windows) == -(
            -T // self.block
        )


class _PreparedCache:
    """The last few plans with their tile masks, keyed on the mask (built-in masks only, by
    their parameters and tensors: see :func:`dikkat.core.masks.describe`), the grid, the tiling
    and the dtype. A repeated call — every step of a training run, every layer of a model —
    plans and evaluates its mask once."""

    def __init__(self, maxsize: int = 8) -> None:
        self.maxsize = maxsize
        self.builds = 0
        self._entries: OrderedDict[tuple, tuple[Mask | None, _Prepared]] = OrderedDict()

    def get(self, key: tuple | None, mask: Mask | None, build) -> _Prepared:
        if key is not None and key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key][1]
        prepared = build()
        self.builds += 1
        if key is not None:
            self._entries[key] = (mask, prepared)  # the mask is held: its tensors' ids stay
            if len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return prepared

    def clear(self) -> None:
        self._entries.clear()
        self.builds = 0


_prepared = _PreparedCache()


def _prepare(mask, shape, q_offset, block, cells, key_tile, windows, dtype, device) -> _Prepared:
    B, H, _, T, S = shape
    description = describe(mask, tensor_identity)
    cacheable = is_builtin(mask)  # a mask of the caller's own may change under us

    def build() -> _Prepared:
        size = block or _choose_block(mask, B * H, T, S, q_offset, cells, key_tile, windows)
        plan = _plan(mask, (B, H, T, S), q_offset, size, cells, key_tile, windows)
        return _Prepared(plan, _TileMasks(mask, shape, q_offset, size, dtype), size)

    key = (description, shape, q_offset, block, cells, key_tile, windows, dtype, str(device))
    return _prepared.get(key if cacheable else None, mask, build)


# Relative speed of a windows tile by its query rows per block, measured here for PyTorch's CPU
# flash kernel (fp32, 1024 keys: 83, 95 and 121 GFLOP/s): it splits a call's rows into chunks of
# 32, of 64 from 192 rows on (and of 256 from 768 on), and longer chunks run faster.
_ROWS_SPEED = {BLOCK // 2: 0.87, BLOCK: 1.0, 2 * BLOCK: 1.27}


def _choose_block(mask, heads, T, S, q_offset, cells, key_tile, windows) -> int:
    """The block size for a windows plan: of 64, 128 and 256 rows, the one with the least cells
    to compute weighted by the kernel's speed at that size (:data:`_ROWS_SPEED`). A window of w
    keys costs each block of b rows b·(w + b) cells: a narrow band gains from small blocks
    (w = 256: 64 rows compute 17 % fewer cells than 128, and ran 16 % faster here); packed
    documents from large ones (1024 tokens: 256 rows compute 11 % more cells, but ran 6 %
    faster). Plans of rows keep :data:`BLOCK`."""
    if mask is None or windows is False:
        return BLOCK

    def cost(block: int) -> float | None:
        plan = _plan(mask, (1, heads, T, S), q_offset, block, cells, key_tile, windows)
        if not plan or not all(isinstance(item, _Windows) for item in plan):
            return None
        computed = sum(item.starts.numel() * block * item.width for item in plan)  # type: ignore[union-attr]
        return computed / _ROWS_SPEED[block]

    costs = {block: cost(block) for block in _ROWS_SPEED}
    if costs[BLOCK] is None:  # not a windows plan
        return BLOCK
    return min((c, block) for block, c in costs.items() if c is not None)[1]


# --- gathering a windows tile --------------------------------------------------------------------


@dataclass
class _Gathered:
    """One windows tile in the kernel's layout (see :func:`_to_kernel`), and where its rows go
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


def _windows_of(x: Tensor, starts: Tensor, W: int) -> Tensor:
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


def _to_kernel(x: Tensor) -> Tensor:
    """(B, G, g, n, block, ·) rows of a windows tile → (B·G, n, g·block, ·): batch and kv heads
    folded into the kernel's batch, the blocks as its heads, the g query heads of a kv head
    stacked (a view when g = 1 and the strides allow)."""
    B, G, g, n, block, C = x.shape
    return x.transpose(2, 3).reshape(B * G, n, g * block, C)


def _from_kernel(x: Tensor, B: int, G: int, g: int) -> Tensor:
    """(B·G, n, g·block, ·) → (B, G, g, n, block, ·): back to the heads' own order."""
    n, C = x.shape[1], x.shape[-1]
    return x.view(B, G, n, g, -1, C).transpose(2, 3)


def _gather(item: _Windows, q: Tensor, k: Tensor, v: Tensor, block: int) -> _Gathered:
    """q (B, G, g, T, D), k and v (B, G, S, ·) → the tile in the kernel's layout."""
    T, S = q.shape[3], k.shape[2]
    W = item.width
    rows, real, view = _window_rows(item, block, T)
    index = (item.starts[:, None] + torch.arange(W)).clamp(max=S - 1).to(q.device)
    t = _Gathered(q, k, v, index, rows.to(q.device), real.to(q.device), view, block)
    t.q = _to_kernel(t.take(q))
    # batch and kv heads fold into one dim: a view of (B, G, n, W, ·) when k and v are laid out
    # (B, G, S, ·) — tiled_attention makes them so once per call when B > 1
    t.k = _windows_of(k, item.starts, W).flatten(0, 1)
    t.v = _windows_of(v, item.starts, W).flatten(0, 1)
    return t


# --- one tile: softmax(q kᵀ·scale + additive) v, and its gradients -----------------------------
#
# q (B, X, R, D), k (B, X, K, D), v (B, X, K, Dv), additive (B|1, X|1, R, K) or None, where X
# counts heads (or blocks). On CPU the tile runs in PyTorch's fused flash kernel, which also
# returns the log-sum-exp; elsewhere (or if that kernel is missing) in plain tensor ops.


def _fused_kernel(q: Tensor, v: Tensor) -> object | None:
    if q.device.type != "cpu" or not FUSED_TILES or v.shape[-1] != q.shape[-1]:
        return None  # the kernel wants one head dim for queries, keys and values
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _tile_forward(
    q: Tensor, k: Tensor, v: Tensor, additive: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """(out (B, X, R, Dv) in the accumulator dtype, lse (B, X, R)); rows whose every key is
    masked get out 0 and an arbitrary lse (the caller sets −inf there)."""
    acc = _acc_dtype(q.dtype)
    kernel = _fused_kernel(q, v)
    if kernel is not None:
        out, lse = kernel(q, k, v, attn_mask=additive, scale=scale)
        return out.to(acc), lse.to(acc)
    s = (q @ k.transpose(-2, -1)).to(acc).mul_(scale)
    if additive is not None:
        s = s.add_(additive.to(acc))
    m = s.amax(-1)
    m = m.masked_fill(torch.isneginf(m), 0.0)
    p = s.sub_(m.unsqueeze(-1)).exp_()
    l = p.sum(-1)  # noqa: E741 — the softmax denominator, as in the papers
    out = (p.to(v.dtype) @ v).to(acc) / l.clamp(min=torch.finfo(acc).tiny).unsqueeze(-1)
    return out, m + torch.log(l)


def _tile_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    additive: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The tile's share of (dq, dk, dv) given the *whole* attention's out and lse (rows with no
    visible key must carry a finite lse; their weights are 0 through the mask)."""
    kernel = _fused_kernel(q, v)
    if kernel is not None:
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        return backward(
            dout,
            q,
            k,
            v,
            out,
            lse.to(_acc_dtype(q.dtype)),
            0.0,
            False,
            attn_mask=additive,
            scale=scale,
        )
    return plain_tile_backward(dout, q, k, v, out, lse, additive, scale)[:3]


def _rows_bias(bias: Tensor | None, G: int, g: int, r0: int, r1: int, k0: int, k1: int):
    t = _bias_tile(bias, G, r0, r1, k0, k1)
    if t is None:
        return None
    return _stack(t.expand(t.shape[0], t.shape[1], g, r1 - r0, k1 - k0))


def _rows_tiles(i: int, item: _Rows, prepared: _Prepared, key_tile: int, device):
    """(k0, k1, tile mask) of each key tile of rows item i that the mask does not hide."""
    for k0 in range(item.k0, item.k1, key_tile):
        k1 = min(k0 + key_tile, item.k1)
        tm = prepared.masks.rows(i, item, k0, k1, device)
        if tm is not False:
            yield k0, k1, tm


def _rows_forward(i, item: _Rows, q, k, v, scale, bias, prepared, key_tile, out, lse):
    B, G, g, _, _ = q.shape
    r0, r1 = item.r0, item.r1
    qb = _stack(q[:, :, :, r0:r1])  # (B, G, g·R, D)
    total_out = total_lse = None
    for k0, k1, tm in _rows_tiles(i, item, prepared, key_tile, q.device):
        additive = _with_bias(tm.additive, _rows_bias(bias, G, g, r0, r1, k0, k1))
        o, l = _tile_forward(qb, k[:, :, k0:k1], v[:, :, k0:k1], additive, scale)  # noqa: E741
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
        out[:, :, :, r0:r1] = _unstack(total_out, g)
        lse[:, :, :, r0:r1] = _unstack(total_lse.expand(B, G, -1), g)


def _windows_forward(i, item: _Windows, q, k, v, scale, prepared, block, out, lse) -> None:
    t = _gather(item, q, k, v, block)
    B, G, g = q.shape[:3]
    n = item.starts.numel()
    tm = prepared.masks.windows(i, item, q.device)
    o, l = _tile_forward(t.q, t.k, t.v, tm.additive, scale)  # noqa: E741 — (B·G, n, g·block, ·)
    if tm.unseen is not None:
        l = l.view(B, G, n, -1).masked_fill(tm.unseen, float("-inf"))  # noqa: E741
    t.scatter(out, _from_kernel(o, B, G, g))
    t.scatter(lse.unsqueeze(-1), _from_kernel(l.reshape(B * G, n, -1, 1), B, G, g))


def _forward(q, k, v, scale, bias, prepared: _Prepared, key_tile):
    block = prepared.block
    B, H, T, D = q.shape
    G, Dv = k.shape[1], v.shape[3]
    qg = q.reshape(B, G, H // G, T, D)  # (B, G, g, T, D): query heads grouped by kv head
    acc_dtype = _acc_dtype(q.dtype)
    if prepared.covers:  # every row is written by some tile
        out = torch.empty(B, G, H // G, T, Dv, dtype=acc_dtype, device=q.device)
        lse = torch.empty(B, G, H // G, T, dtype=acc_dtype, device=q.device)
    else:  # rows that no tile writes see no key: output 0, lse −inf
        out = torch.zeros(B, G, H // G, T, Dv, dtype=acc_dtype, device=q.device)
        lse = torch.full((B, G, H // G, T), float("-inf"), dtype=acc_dtype, device=q.device)
    for i, item in enumerate(prepared.plan):
        if isinstance(item, _Windows):
            _windows_forward(i, item, qg, k, v, scale, prepared, block, out, lse)
        else:
            _rows_forward(i, item, qg, k, v, scale, bias, prepared, key_tile, out, lse)
    return out.view(B, H, T, Dv).to(q.dtype), lse.view(B, H, T)


def _backward(q, k, v, out, lse, dout, scale, bias, prepared: _Prepared, key_tile, bias_grad):
    """(dq, dk, dv, dbias): dbias (the bias's 4-D shape) when ``bias_grad``, else None."""
    block = prepared.block
    B, H, T, D = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    g = H // G
    acc = _acc_dtype(q.dtype)
    qg, og, dog = (x.reshape(B, G, g, T, x.shape[3]) for x in (q, out, dout))
    # rows with no visible key (lse = −inf) get weight 0 through the mask; any finite lse does
    lse_g = lse.view(B, G, g, T).masked_fill(torch.isneginf(lse.view(B, G, g, T)), 0.0)
    dq = torch.zeros(B, G, g, T, D, dtype=acc, device=q.device)
    dk = torch.zeros(B, G, S, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, G, S, Dv, dtype=acc, device=q.device)
    dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if bias_grad else None
    for i, item in enumerate(prepared.plan):
        if isinstance(item, _Windows):
            t = _gather(item, qg, k, v, block)
            n = item.starts.numel()

            def windows(x: Tensor, t=t, n=n) -> Tensor:
                """(B, G, g, T, ·) → this tile's rows in the kernel's layout."""
                rows = t.take(x)
                if t.view is None and not bool(t.real.all()):
                    rows = rows * t.real.view(n, -1, 1)  # padding rows: no gradient
                return _to_kernel(rows)

            tm = prepared.masks.windows(i, item, q.device)
            dob, ob, lb = windows(dog), windows(og), windows(lse_g.unsqueeze(-1)).squeeze(-1)
            dqb, dkb, dvb = _tile_backward(dob, t.q, t.k, t.v, ob, lb, tm.additive, scale)
            t.scatter(dq, _from_kernel(dqb, B, G, g).to(acc))
            index = t.index.flatten()
            dk.index_add_(2, index, dkb.reshape(B, G, -1, D).to(acc))
            dv.index_add_(2, index, dvb.reshape(B, G, -1, Dv).to(acc))
            continue
        r0, r1 = item.r0, item.r1
        qb, ob, dob = (_stack(x[:, :, :, r0:r1]) for x in (qg, og, dog))
        lb = _stack(lse_g[:, :, :, r0:r1].unsqueeze(-1)).squeeze(-1)
        for k0, k1, tm in _rows_tiles(i, item, prepared, key_tile, q.device):
            additive = _with_bias(tm.additive, _rows_bias(bias, G, g, r0, r1, k0, k1))
            tile = (dob, qb, k[:, :, k0:k1], v[:, :, k0:k1], ob, lb, additive, scale)
            if dbias is None:
                dqb, dkb, dvb = _tile_backward(*tile)
            else:  # the fused kernel's backward gives no dS: plain ops for this tile
                dqb, dkb, dvb, ds = plain_tile_backward(*tile)
                add_bias_grad(dbias, ds, g, r0, r1, k0, k1)
            dq[:, :, :, r0:r1] += _unstack(dqb.to(acc), g)
            dk[:, :, k0:k1] += dkb.to(acc)
            dv[:, :, k0:k1] += dvb.to(acc)
    dbias = None if dbias is None else dbias.to(bias.dtype)
    return dq.view(B, H, T, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, bias, prepared, key_tile):
        out, lse = _forward(q, k, v, scale, bias, prepared, key_tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, bias, prepared, key_tile)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[4]
        dq, dk, dv, dbias = _backward(q, k, v, out, lse, dout.contiguous(), *ctx.args, bias_grad)
        return dq, dk, dv, None, dbias, None, None


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None = None,
    *,
    scale: float,
    bias: Tensor | None = None,
    q_offset: int = 0,
    block: int | None = None,
    key_tile: int = KEY_TILE,
    cells: int = CELLS,
    windows: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention in tiles: ``(out (B, H, T, Dv), lse (B, H, T))``, lse in fp32 (fp64 for
    fp64 inputs).

    Differentiable in q, k, v and the bias (:mod:`dikkat.core.tiled_grad`: a tile whose bias
    needs a gradient runs a plain-ops backward, which also gives dS). ``block``, ``key_tile``
    and ``cells`` size the tiles (see the module docstring; ``block`` None: :data:`BLOCK`, or
    for windows the size :func:`_choose_block` finds fastest); ``windows`` forces (True) or
    forbids (False) gathered key windows, which need a mask and no bias.
    """
    for name, value in (("block", block), ("key_tile", key_tile), ("cells", cells)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if bias is not None:  # viewed as (B|1, H|1, T|1, S|1)
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
        windows = False
    B, H, T, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    shape = (B, H, G, T, S)
    prepared = _prepare(mask, shape, q_offset, block, cells, key_tile, windows, q.dtype, q.device)
    if B > 1 and any(isinstance(item, _Windows) for item in prepared.plan):
        # windows fold batch and kv heads into one dim: a view of (B, G, S, ·) only when
        # those two dims are laid out contiguously (one copy of k and v here, not one per tile)
        k, v = k.contiguous(), v.contiguous()
    return _TiledAttention.apply(q, k, v, scale, bias, prepared, key_tile)
