"""How a sequence is cut into per-rank shards, and put back together.

A sequence of ``N`` positions is cut into ``C`` chunks: ``C = W`` for ``"contiguous"`` (rank i
holds chunk i) and ``C = 2W`` for ``"zigzag"`` (rank i holds chunks i and 2W − 1 − i, in this
order, so that under a causal mask every rank has as many early queries as late ones: the
load balancing of the context parallelism of "The Llama 3 Herd of Models", arXiv:2407.21783,
§3.3.2). When ``C`` does not divide ``N``, the first ``N mod C``
chunks get one position more: chunk c holds positions ``c·⌊N/C⌋ + min(c, N mod C)`` onwards.
:func:`gather_sequence` inverts :func:`shard_sequence` exactly.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "LAYOUTS",
    "chunk_bounds",
    "gather_sequence",
    "rank_chunks",
    "shard_positions",
    "shard_sequence",
]

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """``[(start, end), …]`` of the ``chunks`` pieces of ``n`` positions, the first ``n mod
    chunks`` one longer than the rest."""
    base, extra = divmod(n, chunks)
    starts = [c * base + min(c, extra) for c in range(chunks + 1)]
    return list(itertools.pairwise(starts))


def rank_chunks(n: int, rank: int, world: int, layout: str) -> list[tuple[int, int]]:
    """The global ``[start, end)`` ranges rank ``rank`` of ``world`` holds, in its shard's
    order (empty ranges included)."""
    check_layout(layout)
    if layout == "contiguous":
        return [chunk_bounds(n, world)[rank]]
    bounds = chunk_bounds(n, 2 * world)
    return [bounds[rank], bounds[2 * world - 1 - rank]]


def shard_length(n: int, rank: int, world: int, layout: str) -> int:
    return sum(b - a for a, b in rank_chunks(n, rank, world, layout))


def rank_and_world(group: dist.ProcessGroup | None, what: str) -> tuple[int, int]:
    """This process's rank in ``group`` and its size; a ValueError saying how to start one."""
    if not dist.is_available():
        raise ValueError(f"{what} needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        raise ValueError(
            f"{what} needs an initialized process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', init_method=..., rank=..., "
            "world_size=...) in every process first, or start them with torchrun"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _check_dim(x: Tensor, dim: int, name: str) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [-{x.dim()}, {x.dim()}), got {dim!r}")
    return dim % x.dim()


def shard_sequence(
    x: Tensor, dim: int, layout: str = "zigzag", group: dist.ProcessGroup | None = None
) -> Tensor:
    """This rank's shard of the global tensor ``x`` along ``dim`` (the same ``x`` on every
    rank): its chunks (module docstring) concatenated in order. Differentiable."""
    dim = _check_dim(x, dim, "x")
    check_layout(layout)
    rank, world = rank_and_world(group, "shard_sequence")
    parts = [x.narrow(dim, a, b - a) for a, b in rank_chunks(x.shape[dim], rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def shard_positions(
    n: int,
    layout: str = "zigzag",
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The global positions (int64) of this rank's shard of a sequence of ``n`` positions, in its
    shard's order: ``shard_sequence(torch.arange(n), 0, layout, group)`` without building the
    whole range. What a model with position embeddings (RoPE) needs as ``position_ids``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int (the global length), got {n!r}")
    check_layout(layout)
    rank, world = rank_and_world(group, "shard_positions")
    ranges = [torch.arange(a, b, device=device) for a, b in rank_chunks(n, rank, world, layout)]
    return torch.cat(ranges)


def gather_sequence(
    x_local: Tensor, dim: int, layout: str = "zigzag", group: dist.ProcessGroup | None = None
) -> Tensor:
    """The global tensor whose shards (:func:`shard_sequence`) the ranks hold, on every rank.
    The shards must agree on every dim but ``dim``; not differentiable (a collective)."""
    dim = _check_dim(x_local, dim, "x_local")
    check_layout(layout)
    _, world = rank_and_world(group, "gather_sequence")
    mine = torch.tensor([x_local.shape[dim]], device=x_local.device)
    lengths = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(lengths, mine, group=group)
    sizes = [int(t) for t in lengths]
    n = sum(sizes)
    expected = [shard_length(n, r, world, layout) for r in range(world)]
    if sizes != expected:
        raise ValueError(
            f"the ranks hold shards of {sizes} positions along dim {dim}, but the {layout} "
            f"layout of {n} positions over {world} ranks gives {expected}"
        )
    longest = max(sizes)
    pad = list(x_local.shape)
    pad[dim] = longest - x_local.shape[dim]
    padded = torch.cat([x_local, x_local.new_zeros(pad)], dim).contiguous()
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded, group=group)
    pieces: list[tuple[int, Tensor]] = []
    for r, shard in enumerate(shards):
        offset = 0
        for a, b in rank_chunks(n, r, world, layout):
            pieces.append((a, shard.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])], dim)
