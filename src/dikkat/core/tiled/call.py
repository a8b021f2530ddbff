"""One tiled call made ready to run: the fused-kernel choice, the plan, and k and v's layout.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.

Shared by the eager path (:func:`dikkat.core.tiled.tiled_attention`, :func:`tiled_backward`)
and the custom ops of a traced call (:mod:`dikkat.core.tiled.traced`), which run it inside the
op, where reading a mask's values on the host is allowed.
"""

from __future__ import annotations

from torch import Tensor

from dikkat.core.checks import broadcast_kv
from dikkat.core.masks import Mask
from dikkat.core.tiled.cache import PlanCache, Prepared, plans, prepare
from dikkat.core.tiled.kernel import fused_unavailable, unit_last_stride
from dikkat.core.tiled.plan import Windows

__all__ = ["check_tiling", "fused_choice", "prepared_for", "ready", "windows_layout"]


def check_tiling(block: int | None, key_tile: int, cells: int) -> None:
    for name, value in (("block", block), ("key_tile", key_tile), ("cells", cells)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def prepared_for(
    q: Tensor, k: Tensor, mask: Mask | None, bias: Tensor | None, q_offset: int,
    block: int | None, key_tile: int, cells: int, windows: bool | None, cache: PlanCache | None,
) -> Prepared:  # fmt: skip
    """The plan and tile masks of a call of q (B, H, T, D) over k (B, G, S, D)."""
    check_tiling(block, key_tile, cells)
    B, H, T, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    windows = False if bias is not None else windows  # gathered windows carry no bias
    cache = plans if cache is None else cache
    return prepare(mask, (B, H, G, T, S), q_offset, block, cells, key_tile, windows, q.dtype,
                   q.device, cache)  # fmt: skip


def fused_choice(q: Tensor, v: Tensor, fused: bool | None, softcap: float | None) -> bool:
    """Whether the tiles run in the fused CPU kernel (``fused`` None: wherever it can)."""
    reason = fused_unavailable(q, v, softcap)
    if fused and reason is not None:
        raise ValueError(f"fused=True, but the fused kernel cannot run this call: {reason}")
    return reason is None if fused is None else fused


def windows_layout(prepared: Prepared, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k, v as the plan needs them: windows fold batch and kv heads into one dim, a view of
    (B, G, S, ·) only when those two dims are laid out contiguously (one copy of k and v here,
    not one per tile; for k, v shared by the batch, that copy is B of them)."""
    if k.shape[0] > 1 and any(isinstance(item, Windows) for item in prepared.plan):
        return k.contiguous(), v.contiguous()
    return k, v


def ready(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bias: Tensor | None, q_offset: int,
    block: int | None, key_tile: int, cells: int, windows: bool | None, fused: bool | None,
    softcap: float | None, cache: PlanCache | None,
) -> tuple[Tensor, Tensor, Tensor, Prepared, bool]:  # fmt: skip
    """``(q, k, v, prepared, use_fused)`` of a forward call: q, k, v with a unit last stride
    for the fused kernel (copied once here, not once per tile), k and v broadcast to q's batch
    (stride-0 views; autograd sums their gradient) and laid out for the plan."""
    use_fused = fused_choice(q, v, fused, softcap)
    if use_fused:
        q, k, v = (unit_last_stride(t) for t in (q, k, v))
    k, v = broadcast_kv(k, q.shape[0]), broadcast_kv(v, q.shape[0])
    prepared = prepared_for(q, k, mask, bias, q_offset, block, key_tile, cells, windows, cache)
    k, v = windows_layout(prepared, k, v)
    return q, k, v, prepared, use_fused
