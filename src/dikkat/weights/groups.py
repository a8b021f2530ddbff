"""The packed kernel's layout of a weight: rows in groups of 16.

A matrix (N, X) — a packed weight's bytes, or its scales — is held as groups of 16 rows whose
units of ``unit`` elements are interleaved: unit j of the group's row r sits at unit 16 j + r
of the group; a last N % 16 rows stay as they are. With two-byte units, one 32-byte load of
the kernel holds the same two bytes of 16 rows, which it unpacks into 16 lanes (one a row) of
two 16-bit weights each (:mod:`dikkat.kernels`'s ``qmm.cpp``): the rows of a group are
its lanes, and a product needs no sum across lanes. llama.cpp's CPU backend interleaves
blocks of several rows for the same reason (its "repack" layouts, ``block_q4_0x8`` and
others: https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-cpu/repack.cpp).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ROWS", "gather_rows", "to_groups", "to_rows"]

ROWS = 16  # rows a group


def to_groups(t: Tensor, unit: int) -> Tensor:
    """Rows (N, X) → the grouped layout (a copy)."""
    N, X = t.shape
    full = N // ROWS * ROWS
    head = t[:full].reshape(full // ROWS, ROWS, X // unit, unit).transpose(1, 2)
    return torch.cat([head.reshape(full, X), t[full:]])


def to_rows(t: Tensor, unit: int) -> Tensor:
    """The grouped layout (N, X) → rows (a copy): :func:`to_groups` undone."""
    N, X = t.shape
    full = N // ROWS * ROWS
    head = t[:full].reshape(full // ROWS, X // unit, ROWS, unit).transpose(1, 2)
    return torch.cat([head.reshape(full, X), t[full:]])


def gather_rows(t: Tensor, unit: int, index: Tensor) -> Tensor:
    """Rows ``index`` of the grouped layout (N, X), as rows (len(index), X)."""
    N, X = t.shape
    full = N // ROWS * ROWS
    head = None
    if full:  # (groups, units, 16, unit)[group, :, lane, :] → (n, units, unit)
        groups = t[:full].view(full // ROWS, X // unit, ROWS, unit)
        head = groups[index.clamp(max=full - 1) // ROWS, :, index % ROWS, :].reshape(-1, X)
        if full == N:
            return head
    tail = t[full:][(index - full).clamp(min=0)]
    return tail if head is None else torch.where((index < full)[:, None], head, tail)
