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

Each tile — softmax(q kᵀ·scale + mask) v over its rows and keys, with the tile's log-sum-exp —
runs on CPU in PyTorch's fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``,
given the tile's mask as an additive 0/−inf tensor), elsewhere in plain tensor ops; dikkat does
the planning, the skipping, the gathering and the merging across key tiles.

Extra memory is O((T + S)·D + cells), never O(T·S). The backward pass is a custom autograd
function that recomputes each tile's weights from the saved log-sum-exp, following the same
plan, so training memory is O(n) too.

What differs from the reference: the sum runs in a different order (so results differ by
rounding), matmuls run in the input dtype but the softmax statistics and accumulators in fp32
(fp64 for fp64 inputs), and there is no dropout. Rows with every key masked give output 0 and
``lse = −inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.masks import Mask

BLOCK = 128  # query rows per block: the unit of key-range bounds and of windows
KEY_TILE = 4096  # keys per tile in a run of rows; beyond it the online softmax carries over
CELLS = 1 << 22  # score cells per tile, over batch and heads: 16 MiB of fp32 scores
FUSED_TILES = True  # run each tile in PyTorch's fused CPU flash kernel where there is one


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
    if T == 0 or S == 0:
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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


@dataclass
class _Gathered:
    """One windows tile, gathered: queries (B, G, g, n, block, D), keys and values
    (B, G, 1, n, W, ·), the allowed pairs, and the key index of every window slot."""

    q: Tensor
    k: Tensor
    v: Tensor
    allowed: Tensor
    index: Tensor  # (n, W), clamped into 0 … S − 1 (slots past S are masked)
    rows: Tensor  # (n·block,) query row of each gathered row, clamped into 0 … T − 1
    real: Tensor  # (n·block,) False for the rows past T that pad the last block

    def scatter(self, dst: Tensor, src: Tensor) -> None:
        """dst[..., rows, ·] = src[..., rows, ·] for the real rows (dim 3 of (B, G, g, rows, ·))."""
        if self.padded:
            dst.index_copy_(3, self.rows[self.real], src[:, :, :, self.real])
        else:
            dst.index_copy_(3, self.rows, src)

    @property
    def padded(self) -> bool:
        return self.rows.numel() > int(self.real.sum())


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


def _gather(
    item: _Windows, q: Tensor, k: Tensor, v: Tensor, mask: Mask, q_offset: int, block: int
) -> _Gathered:
    B, G, g, T, D = q.shape
    S = k.shape[2]
    n, W = item.starts.numel(), item.width
    rows = item.blocks.to(q.device)[:, None] * block + torch.arange(block, device=q.device)
    rows = rows.flatten()
    real = rows < T  # the last block may run past T: its extra rows are computed and dropped
    rows = rows.clamp(max=T - 1)
    qb = q[:, :, :, rows]  # (B, G, g, n·block, D)
    index = item.starts.to(q.device)[:, None] + torch.arange(W, device=q.device)  # (n, W)
    inside = index < S
    index = index.clamp(max=S - 1)
    qpos = (q_offset + rows).view(n, block, 1)
    allowed = mask.predicate(
        torch.arange(B, device=q.device).view(B, 1, 1, 1, 1),
        torch.arange(G * g, device=q.device).view(1, -1, 1, 1, 1),
        qpos,
        index.view(n, 1, W),
    )
    allowed = _heads(allowed & inside.view(n, 1, W), G, g, 3)
    return _Gathered(
        qb.view(B, G, g, n, block, D),
        _windows_of(k, item.starts, W).unsqueeze(2),  # (B, G, 1, n, W, D)
        _windows_of(v, item.starts, W).unsqueeze(2),
        allowed,
        index,
        rows,
        real,
    )


# --- one tile: softmax(q kᵀ·scale + additive) v, and its gradients -----------------------------
#
# q (B, X, R, D), k (B, X, K, D), v (B, X, K, Dv), additive (B|1, X|1, R, K) or None, where X
# counts heads (or heads × blocks). On CPU the tile runs in PyTorch's fused flash kernel, which
# also returns the log-sum-exp; elsewhere (or if that kernel is missing) in plain tensor ops.


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
    acc = _acc_dtype(q.dtype)
    s = (q @ k.transpose(-2, -1)).to(acc).mul_(scale)
    if additive is not None:
        s = s.add_(additive.to(acc))
    p = s.sub_(lse.to(acc).unsqueeze(-1)).exp_()  # the weights, recomputed from the lse
    delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
    dv = p.to(dout.dtype).transpose(-2, -1) @ dout
    ds = p.mul_((dout @ v.transpose(-2, -1)).to(acc).sub_(delta)).mul_(scale).to(q.dtype)
    return ds @ k, ds.transpose(-2, -1) @ q, dv


def _additive(allowed: Tensor | bool | None, bias: Tensor | None, dtype: torch.dtype):
    """The mask (and bias) as one additive float tensor: 0 where allowed, −inf where not."""
    if not isinstance(allowed, Tensor):
        return None if bias is None else bias.to(dtype)
    add = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    add = add.masked_fill_(~allowed, float("-inf"))
    return add if bias is None else add + bias.to(dtype)


# --- layouts -----------------------------------------------------------------------------------
#
# A kv head serves g query heads; stacking those g heads' rows, (B, G, g, R, ·) → (B, G, g·R, ·),
# lets one call share each key tile among them without repeating k and v.


def _stack(x: Tensor) -> Tensor:
    """(B, G, g, R, ·) → (B, G, g·R, ·)."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _unstack(x: Tensor, g: int) -> Tensor:
    """(B, G, g·R, ·) → (B, G, g, R, ·)."""
    return x.reshape(x.shape[0], x.shape[1], g, x.shape[2] // g, *x.shape[3:])


def _rows_allowed(mask, B, H, G, g, r0, r1, k0, k1, device) -> Tensor | bool | None:
    """A rows tile's allowed pairs stacked like the queries: (B|1, G|1, g·R, K)."""
    allowed = _tile_mask(mask, B, H, G, r0, r1, k0, k1, device)
    if not isinstance(allowed, Tensor):
        return allowed
    return _stack(allowed.expand(*allowed.shape[:2], g, r1 - r0, k1 - k0))


def _rows_bias(bias: Tensor | None, G: int, g: int, r0: int, r1: int, k0: int, k1: int):
    t = _bias_tile(bias, G, r0, r1, k0, k1)
    if t is None:
        return None
    return _stack(t.expand(t.shape[0], t.shape[1], g, r1 - r0, k1 - k0))


def _windows_layout(t: _Gathered) -> tuple[Tensor, Tensor, Tensor]:
    """A windows tile as one kernel call, batch and kv heads folded into the kernel's batch and
    the blocks into its heads: (B·G, n, g·block, D) queries (the g query heads that share a kv
    head stacked), (B·G, n, W, ·) keys and values (views when the windows are)."""
    B, G, g, n, block, D = t.q.shape
    q = t.q.transpose(2, 3).reshape(B * G, n, g * block, D)
    return q, t.k.squeeze(2).flatten(0, 1), t.v.squeeze(2).flatten(0, 1)


def _windows_mask(t: _Gathered, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The tile's additive mask, (1 | B·G, n, g·block, W) like :func:`_windows_layout`'s scores,
    and the rows that see no key, (B|1, G|1, n, g·block). A mask that depends on neither batch
    nor head (most do not) is built once and broadcast over the kernel's batch."""
    B, G, g, n, block, _ = t.q.shape
    W = t.k.shape[-2]
    a = t.allowed  # (B|1, G|1, g|1, n, block, W)
    Bm, Gm = a.shape[:2]
    a = a.expand(Bm, Gm, g, n, block, W).transpose(2, 3).reshape(Bm, Gm, n, g * block, W)
    unseen = ~a.any(-1)
    if Bm * Gm > 1:
        a = a.expand(B, G, n, g * block, W).reshape(B * G, n, g * block, W)
    else:
        a = a.view(1, n, g * block, W)
    return _additive(a, None, dtype), unseen


def _windows_unfold(x: Tensor, B: int, G: int, g: int) -> Tensor:
    """(B·G, n, g·block, ·) → (B, G, g, n·block, ·): back to the heads' own row order."""
    n, C = x.shape[1], x.shape[-1]
    return x.view(B, G, n, g, -1, C).transpose(2, 3).reshape(B, G, g, -1, C)


def _rows_forward(item: _Rows, q, k, v, mask, scale, bias, q_offset, key_tile, out, lse):
    B, G, g, _, _ = q.shape
    r0, r1 = item.r0, item.r1
    qb = _stack(q[:, :, :, r0:r1])  # (B, G, g·R, D)
    total_out = total_lse = None
    for k0 in _key_tiles(item, key_tile):
        k1 = min(k0 + key_tile, item.k1)
        allowed = _rows_allowed(
            mask, B, G * g, G, g, r0 + q_offset, r1 + q_offset, k0, k1, q.device
        )
        if allowed is False:
            continue  # nothing visible here: skip the tile entirely
        additive = _additive(allowed, _rows_bias(bias, G, g, r0, r1, k0, k1), q.dtype)
        o, l = _tile_forward(qb, k[:, :, k0:k1], v[:, :, k0:k1], additive, scale)  # noqa: E741
        if isinstance(allowed, Tensor):  # rows with no visible key in this tile
            l = l.masked_fill(~allowed.any(-1), float("-inf"))  # noqa: E741
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


def _windows_forward(item: _Windows, q, k, v, mask, scale, q_offset, block, out, lse) -> None:
    t = _gather(item, q, k, v, mask, q_offset, block)
    B, G, g, n = t.q.shape[:4]
    additive, unseen = _windows_mask(t, q.dtype)
    o, l = _tile_forward(*_windows_layout(t), additive, scale)  # noqa: E741 — (B·G, n, g·block, ·)
    l = l.view(B, G, n, -1).masked_fill(unseen, float("-inf"))  # noqa: E741
    t.scatter(out, _windows_unfold(o, B, G, g))
    t.scatter(lse.unsqueeze(-1), _windows_unfold(l.view(B * G, n, -1, 1), B, G, g))


def _forward(q, k, v, mask, scale, bias, q_offset, plan, block, key_tile):
    B, H, T, _ = q.shape
    G, Dv = k.shape[1], v.shape[3]
    qg = q.reshape(B, G, H // G, T, -1)  # (B, G, g, T, D): query heads grouped by kv head
    acc_dtype = _acc_dtype(q.dtype)
    out = torch.zeros(B, G, H // G, T, Dv, dtype=acc_dtype, device=q.device)
    lse = torch.full((B, G, H // G, T), float("-inf"), dtype=acc_dtype, device=q.device)
    for item in plan:
        if isinstance(item, _Windows):
            _windows_forward(item, qg, k, v, mask, scale, q_offset, block, out, lse)
        else:
            _rows_forward(item, qg, k, v, mask, scale, bias, q_offset, key_tile, out, lse)
    return out.view(B, H, T, Dv).to(q.dtype), lse.view(B, H, T)


def _backward(q, k, v, out, lse, dout, mask, scale, bias, q_offset, plan, block, key_tile):
    B, H, T, D = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    g = H // G
    acc = _acc_dtype(q.dtype)
    qg, og, dog = (x.reshape(B, G, g, T, -1) for x in (q, out, dout))
    # rows with no visible key (lse = −inf) get weight 0 through the mask; any finite lse does
    lse_g = lse.view(B, G, g, T).masked_fill(torch.isneginf(lse.view(B, G, g, T)), 0.0)
    dq = torch.zeros(B, G, g, T, D, dtype=acc, device=q.device)
    dk = torch.zeros(B, G, S, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, G, S, Dv, dtype=acc, device=q.device)
    for item in plan:
        if isinstance(item, _Windows):
            t = _gather(item, qg, k, v, mask, q_offset, block)
            n = t.q.shape[3]

            def windows(x: Tensor, t=t, n=n) -> Tensor:
                """(B, G, g, T, ·) → this tile's rows, (B·G, n, g·block, ·) like its queries."""
                x = x[:, :, :, t.rows] * t.real.view(-1, 1)  # padding rows: no gradient
                x = x.reshape(B, G, g, n, block, -1).transpose(2, 3)
                return x.reshape(B * G, n, g * block, -1)

            dob, ob, lb = windows(dog), windows(og), windows(lse_g.unsqueeze(-1)).squeeze(-1)
            additive, _ = _windows_mask(t, q.dtype)
            dqb, dkb, dvb = _tile_backward(dob, *_windows_layout(t), ob, lb, additive, scale)
            t.scatter(dq, _windows_unfold(dqb, B, G, g).to(acc))
            index = t.index.flatten()
            dk.index_add_(2, index, dkb.reshape(B, G, -1, D).to(acc))
            dv.index_add_(2, index, dvb.reshape(B, G, -1, Dv).to(acc))
            continue
        r0, r1 = item.r0, item.r1
        qb, ob, dob = (_stack(x[:, :, :, r0:r1]) for x in (qg, og, dog))
        lb = _stack(lse_g[:, :, :, r0:r1].unsqueeze(-1)).squeeze(-1)
        for k0 in _key_tiles(item, key_tile):
            k1 = min(k0 + key_tile, item.k1)
            allowed = _rows_allowed(
                mask, B, H, G, g, r0 + q_offset, r1 + q_offset, k0, k1, q.device
            )
            if allowed is False:
                continue
            additive = _additive(allowed, _rows_bias(bias, G, g, r0, r1, k0, k1), q.dtype)
            dqb, dkb, dvb = _tile_backward(
                dob, qb, k[:, :, k0:k1], v[:, :, k0:k1], ob, lb, additive, scale
            )
            dq[:, :, :, r0:r1] += _unstack(dqb.to(acc), g)
            dk[:, :, k0:k1] += dkb.to(acc)
            dv[:, :, k0:k1] += dvb.to(acc)
    return dq.view(B, H, T, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, bias, q_offset, plan, block, key_tile):
        out, lse = _forward(q, k, v, mask, scale, bias, q_offset, plan, block, key_tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (mask, scale, bias, q_offset, plan, block, key_tile)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, dout.contiguous(), *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None = None,
    *,
    scale: float,
    bias: Tensor | None = None,
    q_offset: int = 0,
    block: int = BLOCK,
    key_tile: int = KEY_TILE,
    cells: int = CELLS,
    windows: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention in tiles: ``(out (B, H, T, Dv), lse (B, H, T))``, lse in fp32 (fp64 for
    fp64 inputs).

    Differentiable in q, k and v (the bias is treated as a constant). ``block``, ``key_tile``
    and ``cells`` size the tiles (see the module docstring); ``windows`` forces (True) or
    forbids (False) gathered key windows, which need a mask and no bias.
    """
    for name, value in (("block", block), ("key_tile", key_tile), ("cells", cells)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if bias is not None:  # a constant, viewed as (B|1, H|1, T|1, S|1)
        bias = bias.detach()
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
        windows = False
    B, H, T, _ = q.shape
    plan = _plan(mask, (B, H, T, k.shape[2]), q_offset, block, cells, key_tile, windows)
    if B > 1 and any(isinstance(item, _Windows) for item in plan):
        # windows fold batch and kv heads into one dim: a view of (B, G, S, ·) only when
        # those two dims are laid out contiguously (one copy of k and v here, not one per tile)
        k, v = k.contiguous(), v.contiguous()
    return _TiledAttention.apply(q, k, v, mask, scale, bias, q_offset, plan, block, key_tile)
