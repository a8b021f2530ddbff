"""One rank's work on one key/value block: which chunk pairs it computes, their forward through
:func:`dikkat.attention`, and their backward, on the tiled backend, from the final log-sum-exp.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (``g = H / G``), ``T``/``S``
query/key length of a chunk, ``D``/``Dv`` head dims.

A rank's queries and a block's keys are each one or two chunks of contiguous global positions
(:mod:`dikkat.distributed.layout`). Each (query chunk, key chunk) pair is one attention call with
``q_offset`` the queries' first global position and the mask wrapped in :class:`ShiftedKeys`,
which moves the keys to theirs: the mask sees global positions, and its ``kv_range`` still lets
the tiled backend skip what it hides. A pair whose keys the mask hides from all its queries
(``Mask.kv_range`` on global positions) is not computed at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.attention import attention
from dikkat.core.masks import Mask
from dikkat.core.tiled import tiled_backward

Range = tuple[int, int]  # global positions [start, end)


@dataclass(frozen=True, eq=False)
class ShiftedKeys(Mask):
    """``inner`` with the keys moved: key j of the call is global key ``offset + j``. The
    queries' global positions come in as the call's ``q_offset``. It is checked once, on the
    global (T, S) grid, before the ring runs, so :meth:`validate` checks nothing."""

    inner: Mask
    offset: int
    total: int  # global key count

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.inner.predicate(b, h, q_idx, kv_idx + self.offset)

    def _local(self, lo: int, hi: int, S: int) -> Range:
        lo, hi = max(lo - self.offset, 0), min(hi - self.offset, S)
        return (lo, hi) if lo < hi else (0, 0)

    def kv_range(self, q0: int, q1: int, S: int) -> Range:
        return self._local(*self.inner.kv_range(q0, q1, self.total), S)

    def kv_full_range(self, q0: int, q1: int, S: int) -> Range:
        return self._local(*self.inner.kv_full_range(q0, q1, self.total), S)

    @property
    def is_full(self) -> bool:
        return self.inner.is_full


def pair_needed(mask: Mask | None, rows: Range, keys: Range, S_total: int) -> bool:
    """Whether any query of ``rows`` may see a key of ``keys`` (conservatively: True unless the
    mask's key range on global positions misses the chunk)."""
    if rows[0] >= rows[1] or keys[0] >= keys[1]:
        return False
    if mask is None:
        return True
    lo, hi = mask.kv_range(rows[0], rows[1], S_total)
    return max(lo, keys[0]) < min(hi, keys[1])


def pairs(
    mask: Mask | None, q_chunks: list[Range], k_chunks: list[Range], S_total: int
) -> list[tuple[int, int, int, int]]:
    """``(q_local_start, q_chunk, k_local_start, k_chunk)`` indices of the pairs to compute."""
    out = []
    q_start = 0
    for qi, rows in enumerate(q_chunks):
        k_start = 0
        for ki, keys in enumerate(k_chunks):
            if pair_needed(mask, rows, keys, S_total):
                out.append((q_start, qi, k_start, ki))
            k_start += keys[1] - keys[0]
        q_start += rows[1] - rows[0]
    return out


def _shifted(mask: Mask | None, keys: Range, S_total: int) -> Mask | None:
    return None if mask is None else ShiftedKeys(mask, keys[0], S_total)


def merge(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:  # noqa: E741
    """Two partial results of the same rows, by their log-sum-exp:
    out = Σ exp(lse_i − lse) out_i (rows with lse −inf on both sides stay 0 and −inf)."""
    new = torch.logaddexp(lse, l)
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    merged = out * torch.exp(lse - safe).unsqueeze(-1) + o * torch.exp(l - safe).unsqueeze(-1)
    return merged, new


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, scale: float, q_chunks: list[Range],
    k_chunks: list[Range], S_total: int, out: Tensor, lse: Tensor,
) -> int:  # fmt: skip
    """Merge this block's pairs into ``out`` (B, H, T_local, Dv) and ``lse`` (B, H, T_local),
    in place; returns the number of pairs computed."""
    todo = pairs(mask, q_chunks, k_chunks, S_total)
    for q_start, qi, k_start, ki in todo:
        rows, keys = q_chunks[qi], k_chunks[ki]
        t, s = rows[1] - rows[0], keys[1] - keys[0]
        o, (_, l) = attention(  # noqa: E741
            q[:, :, q_start : q_start + t],
            k[:, :, k_start : k_start + s],
            v[:, :, k_start : k_start + s],
            _shifted(mask, keys, S_total),
            scale=scale,
            q_offset=rows[0],
            return_lse=True,
        )
        sl = slice(q_start, q_start + t)
        out[:, :, sl], lse[:, :, sl] = merge(out[:, :, sl], lse[:, :, sl], o.to(out.dtype), l)
    return len(todo)


def block_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, mask: Mask | None,
    scale: float, q_chunks: list[Range], k_chunks: list[Range], S_total: int, dq: Tensor,
    dk: Tensor, dv: Tensor,
) -> None:  # fmt: skip
    """Add this block's share of the gradients to ``dq`` (B, H, T_local, D), ``dk`` (B, G,
    S_block, D) and ``dv`` in place, given the ring's final ``out`` and ``lse``: each pair the
    forward computed runs :func:`~dikkat.core.tiled.tiled_backward` (the tiled backend's plan
    and kernels, the weights recomputed from the final lse), on the same global positions."""
    for q_start, qi, k_start, ki in pairs(mask, q_chunks, k_chunks, S_total):
        rows, keys = q_chunks[qi], k_chunks[ki]
        qs = slice(q_start, q_start + rows[1] - rows[0])  # local query rows
        ks = slice(k_start, k_start + keys[1] - keys[0])  # local keys of the block
        grads = tiled_backward(
            q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs], dout[:, :, qs],
            _shifted(mask, keys, S_total), scale=scale, q_offset=rows[0],
        )  # fmt: skip
        dq[:, :, qs] += grads[0]
        dk[:, :, ks] += grads[1]
        dv[:, :, ks] += grads[2]
