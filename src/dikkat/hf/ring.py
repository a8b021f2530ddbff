"""Hugging Face models with their sequence split over processes: every attention layer as
:func:`dikkat.distributed.ring_attention` (context parallelism; docs/distributed.md, "Hugging
Face models").

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` this rank's tokens, ``N``
the whole sequence's, ``D`` head dim.

Every rank runs the same model on its shard of the sequence — the ids cut by
:func:`~dikkat.distributed.shard_sequence`, ``position_ids`` from
:func:`~dikkat.distributed.shard_positions` so that RoPE sees global positions — and each layer's
q, k, v (B, ·, T, D) go round the ring, every query seeing all N keys. transformers builds each
layer's mask for the T local tokens numbered from 0; the ring needs the mask of the N global
positions. A mask that depends only on ``q − kv`` (causal, a sliding window, bidirectional) is
the same predicate on global positions, so :func:`ring_mask` keeps it; one that depends on the
local indices or on data — padding, packed sequences, chunks, a cache's offsets, a model's own
predicates — cannot be moved to global positions from one rank's view and is refused. So is
everything the ring does not compute (dropout, soft-capping, a position bias, the weights).

A refusal that depends on a rank's data (its shard of a padding mask, its position ids) is
agreed on by all ranks before the ring starts: every rank raises, none is left waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dikkat.core.masks import Causal, Full, Mask, SlidingWindow
from dikkat.distributed.layout import check_layout, rank_and_world, shard_positions
from dikkat.distributed.ring import ring_attention
from dikkat.hf.attention import check_name, install
from dikkat.hf.keywords import check_keywords
from dikkat.hf.masks import _captured, _convert, _Grid, _name

__all__ = ["RingMask", "register_ring", "ring_mask"]

# Keyword arguments a layer passes whose meaning the ring does not compute: refused, never ignored
# (those dikkat.hf.KEYWORDS does not know, or refuses, are refused before these).
_UNSUPPORTED = {
    "softcap": "soft-capping of the scores (Gemma 2's attn_logit_softcapping)",
    "position_bias": "an additive position bias (T5's relative attention bias)",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "indices": "sparse attention's key indices",
    "cu_seq_lens_q": "packed sequences (flash-attention's cumulative lengths)",
    "cu_seq_lens_k": "packed sequences (flash-attention's cumulative lengths)",
}
_PACKED = "packed_sequence_mask_function.<locals>.inner_mask"
_REMAP = "remap_positions_for_packed_sequence.<locals>.inner_mask"


@dataclass(frozen=True, eq=False)
class RingMask:
    """What :func:`ring_mask` hands a model, for its attention layers to pass on.

    ``mask`` is on global positions (None: every key); ``refusal`` says why this rank's mask
    cannot be made global (raised by the layers, on every rank together); ``positions`` are the
    position ids transformers built the mask from, when it passed them (checked to be global
    too); (B, T, S) is the local shape it was built for.
    """

    mask: Mask | None
    refusal: str | None
    positions: Tensor | None
    batch: int
    q_length: int
    kv_length: int

    ndim = 4  # transformers passes a mask with four dimensions through unchanged

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, 1, self.q_length, self.kv_length)


def register_ring(
    name: str = "dikkat_ring",
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
) -> str:
    """Register ring attention over ``group`` with transformers under ``name``: afterwards a
    model with ``attn_implementation=name`` runs every attention layer as
    :func:`~dikkat.distributed.ring_attention` on the rank's shard of the sequence, cut in
    ``layout`` (``"zigzag"`` or ``"contiguous"``). Call the model on every rank with the rank's
    shard of the ids, ``position_ids=shard_positions(N, layout)[None]`` and ``use_cache=False``;
    the logits are the rank's shard of the whole sequence's. Returns ``name``.
    """
    check_name(name)
    check_layout(layout)
    install(name, ring_attention_function(group, layout), ring_mask, "register_ring")
    return name


def ring_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | RingMask | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> RingMask:
    """The mask function :func:`register_ring` gives ``AttentionMaskInterface``: the arguments of
    ``transformers.masking_utils.sdpa_mask`` in, the mask on global positions out, or the reason
    there is none (:class:`RingMask`; it never raises, so that every rank can refuse together).
    """
    from transformers.masking_utils import causal_mask_function  # optional dependency

    if isinstance(attention_mask, RingMask):  # prepared ahead: as it is
        return attention_mask

    def refused(reason: str) -> RingMask:
        return RingMask(None, reason, None, batch_size, q_length, kv_length)

    if int(q_offset) or kv_offset or kv_length != q_length:
        return refused(
            f"a KV cache: the queries start at position {int(q_offset)} of {kv_length} keys "
            f"(from {kv_offset}), but the ring attends one whole sequence in one call; call the "
            "model with use_cache=False"
        )
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
            return refused(
                f"an attention_mask of type {type(attention_mask).__name__} (shape "
                f"{tuple(getattr(attention_mask, 'shape', ()))}): only a 2-D mask of ones can be "
                "taken to global positions"
            )
        if not bool(attention_mask.bool().all()):
            return refused(
                "padding: this rank's attention_mask has zeros, and padded sequences are not "
                "supported by the ring (pass sequences of real tokens, attention_mask=None)"
            )
    base = causal_mask_function if mask_function is None else mask_function
    fn, positions = _without_packing(base)
    grid = _Grid(batch_size, q_length, kv_length, 0, 0, device, use_vmap)
    mask = _convert(fn, grid)
    if type(mask) not in (Causal, SlidingWindow, Full):
        return refused(
            f"transformers built a mask that becomes {type(mask).__name__} (padding, packed "
            "sequences, chunked attention or a model's own predicate), which depends on local "
            "indices; the ring takes only causal, sliding-window and bidirectional masks"
        )
    return RingMask(None if isinstance(mask, Full) else mask, None, positions, batch_size,
                    q_length, kv_length)  # fmt: skip


def _without_packing(fn: Callable) -> tuple[Callable, Tensor | None]:
    """transformers reads position ids that jump — as a zigzag shard's do, [0 … 5, 16 … 21] — as
    packed sequences, and wraps the base mask in ``remap_positions_for_packed_sequence`` and
    ``packed_sequence_mask_function``. The base mask, and the position ids to check: if they are
    this rank's global positions, the jump is the layout's and not a second sequence."""
    if _name(fn) != "and_masks.<locals>.and_mask":
        return fn, None
    parts = list(_captured(fn)["mask_functions"])
    names = [_name(f) for f in parts]
    if sorted(names) != sorted([_PACKED, _REMAP]):
        return fn, None  # anything else with them: converted as it is, and refused
    remap = _captured(parts[names.index(_REMAP)])
    return remap["mask_function"], remap["position_ids"]


def ring_attention_function(
    group: dist.ProcessGroup | None = None, layout: str = "zigzag"
) -> Callable[..., tuple[Tensor, None]]:
    """The function ``AttentionInterface`` calls: this rank's q (B, H, T, D), k and v (B, G, T,
    D) through :func:`~dikkat.distributed.ring_attention` over ``group``; out (B, T, H, D)."""
    check_layout(layout)

    def dikkat_ring_attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: RingMask | Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        layer = f"{type(module).__name__}[{getattr(module, 'layer_idx', '?')}]"
        B, T, S = query.shape[0], query.shape[2], key.shape[2]
        _refuse_arguments(layer, T, S, dropout, kwargs)
        mask, refusal, built_from = _global_mask(layer, module, attention_mask, (B, T, S))
        if refusal is None:
            refusal = _check_window(mask, kwargs.get("sliding_window"))
        _, world = rank_and_world(group, "dikkat's ring attention")
        n = int(sum(_all_gather(torch.tensor([T], device=query.device), group, world)))
        if refusal is None:
            expected = shard_positions(n, layout, group, device=query.device)
            refusal = _check_positions(kwargs.get("position_ids"), built_from, expected)
        _agree(layer, refusal, group, world, query.device)
        out = ring_attention(query, key, value, mask, group=group, layout=layout, scale=scaling)
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, Dv)

    dikkat_ring_attention.__qualname__ = f"dikkat_ring_attention[{layout}]"
    return dikkat_ring_attention


def _refuse_arguments(layer: str, T: int, S: int, dropout: float, kwargs: dict[str, Any]) -> None:
    """What the layer asks for that the ring does not do: the same on every rank (one model, one
    call), so raised at once."""

    def refuse(what: str) -> NoReturn:
        raise ValueError(f"dikkat's ring attention cannot run {layer}: {what}")

    check_keywords(layer, kwargs, has_mask=True)  # the ring checks the window itself
    for word, what in _UNSUPPORTED.items():
        if kwargs.get(word) is not None:
            refuse(f"{word}= ({what}) is not supported by ring_attention")
    if dropout:
        refuse(f"attention dropout (dropout={dropout}, the model in training mode) is not "
               "supported by ring_attention: set the model's attention dropout to 0")  # fmt: skip
    if kwargs.get("output_attentions"):
        refuse("output_attentions=True: the weights of the whole sequence are what the ring "
               "exists not to hold (dikkat.capture on one process serves them)")  # fmt: skip
    if kwargs.get("use_cache"):
        refuse("use_cache=True: each rank's cache would hold only its shard's keys, which no "
               "later call could use; call the model with use_cache=False")  # fmt: skip
    if S != T:
        refuse(f"{T} queries over {S} keys (cross-attention, or a KV cache): the ring attends a "
               "sequence to itself, as many keys as queries on each rank")  # fmt: skip


def _global_mask(
    layer: str, module: nn.Module, attention_mask: RingMask | Tensor | None,
    shape: tuple[int, int, int],
) -> tuple[Mask | None, str | None, Tensor | None]:  # fmt: skip
    """(mask on global positions, this rank's refusal, the position ids it was built from)."""
    if isinstance(attention_mask, RingMask):
        built = (attention_mask.batch, attention_mask.q_length, attention_mask.kv_length)
        if built[1:] != shape[1:] or built[0] not in (1, shape[0]):
            raise ValueError(
                f"the attention mask was built for (B, T, S) = {built} but {layer} attends "
                f"with (B, T, S) = {shape}"
            )
        return attention_mask.mask, attention_mask.refusal, attention_mask.positions
    if attention_mask is None and not getattr(module, "is_causal", False):
        return None, None, None  # a bidirectional layer that no mask function reached
    what = "no mask" if attention_mask is None else f"a {type(attention_mask).__name__}"
    raise ValueError(
        f"dikkat's ring attention cannot run {layer}: it received {what} where dikkat's ring "
        "mask function's RingMask belongs; a mask built for the local positions cannot be "
        "taken to global ones. Register with dikkat.hf.register_ring(name), which registers "
        "both functions, and do not pass a prepared 4-D mask"
    )


def _check_window(mask: Mask | None, window: int | None) -> str | None:
    """A layer that names its sliding window (Mistral, Gemma 2) must have received that window."""
    if window is None or (
        isinstance(mask, SlidingWindow) and mask.window == window and mask.ahead == 0
    ):
        return None
    return f"the layer passes sliding_window={window} but its mask is {mask!r}"


def _check_positions(
    position_ids: Tensor | None, built_from: Tensor | None, expected: Tensor
) -> str | None:
    """Why the model's position ids are not this rank's global positions, or None."""
    if position_ids is None:
        return (
            "the layer receives no position_ids, so dikkat cannot check that the model saw this "
            "rank's global positions (the ring computes attention over global positions; models "
            "whose layers pass position_ids, as Llama, Mistral and Gemma 2 do, are supported)"
        )
    for name, ids in (("position_ids", position_ids), ("the mask's position ids", built_from)):
        if ids is None:
            continue
        if ids.shape[-1] != expected.numel() or not bool((ids == expected).all()):
            got = _brief(ids.reshape(-1, ids.shape[-1])[0])
            return (
                f"{name} {got} are not this rank's global positions {_brief(expected)} (pass "
                "position_ids=dikkat.distributed.shard_positions(N, layout)[None]; packed "
                "sequences are not supported)"
            )
    return None


def _brief(positions: Tensor, keep: int = 4) -> str:
    """``[0, 1, 2, 3, …, 20] (11)``: the ends of a long row of positions, and its length."""
    values = positions.tolist()
    if len(values) <= 2 * keep:
        return str(values)
    ends = [*map(str, values[:keep]), "…", *map(str, values[-keep:])]
    return f"[{', '.join(ends)}] ({len(values)})"


def _all_gather(t: Tensor, group: dist.ProcessGroup | None, world: int) -> list[Tensor]:
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return out


def _agree(
    layer: str, refusal: str | None, group: dist.ProcessGroup | None, world: int,
    device: torch.device,
) -> None:  # fmt: skip
    """Raise on every rank when any rank refuses the call, rather than on that one alone while
    the others wait in the ring until the process group's timeout."""
    flags = _all_gather(torch.tensor([int(refusal is not None)], device=device), group, world)
    refusing = [r for r, f in enumerate(flags) if bool(f)]
    if refusal is not None:
        raise ValueError(f"dikkat's ring attention cannot run {layer}: {refusal}")
    if refusing:
        raise ValueError(
            f"dikkat's ring attention cannot run {layer}: rank(s) {refusing} of the group "
            "refused this call (their error says why), so this rank stops with them"
        )
