"""Hugging Face's mask functions as dikkat masks, so the tiled backend skips what they hide.

Notation: ``B`` batch, ``T`` query length, ``S`` key length (HF's ``q_length`` and
``kv_length``).

transformers (≥ 5.24.0) builds every attention mask from predicates ``(batch_idx, head_idx,
q_idx, kv_idx) -> bool`` in ``transformers.masking_utils`` — ``causal_mask_function``, the
sliding-window and chunked overlays, packed sequences, padding — combined with ``and_masks`` /
``or_masks``, and hands the combined predicate to the mask function registered for the model's
``attn_implementation`` (``AttentionMaskInterface``). :func:`hf_mask` is dikkat's: it reads
that tree of predicates back (the closures transformers builds keep their parameters) and
rebuilds it from dikkat's masks, whose ``kv_range`` bounds tell the tiled backend which keys a
block of queries can see (a bidirectional sliding window, ``|q − kv| ≤ w``, becomes a window
that looks ahead). A predicate it does not recognise (a model's own ``or_mask_function``) is
evaluated densely by transformers' own ``sdpa_mask`` and kept as a
:class:`~dikkat.masks.DenseMask` — exact, only without the skipping.

Coordinates: transformers numbers keys from ``kv_offset`` (a sliding-window cache keeps only the
last keys) and queries from ``q_offset``; dikkat numbers the keys it is given from 0. The masks
are therefore built in dikkat's coordinates, shifted by ``kv_offset``, and the query offset the
attention call needs is ``q_offset − kv_offset`` (:attr:`HFMask.q_offset`). Causal and sliding
masks depend only on ``q − kv`` and are unchanged by the shift; padding, chunks and packed
sequences are indexed with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dikkat.core import masks
from dikkat.core.masks import Causal, Full, Mask, SlidingWindow
from dikkat.core.tracing import tracing

__all__ = ["HFMask", "hf_mask"]

_HF = "transformers.masking_utils"


@dataclass(frozen=True, eq=False)
class HFMask:
    """What dikkat's mask function hands a model, for its attention layers to pass on.

    ``mask`` is in dikkat's coordinates (None: every key), ``q_offset`` the absolute position of
    the first query among the keys passed to attention, and (B, T, S) the shape it was built
    for, checked against every attention call that receives it.
    """

    mask: Mask | None
    q_offset: int
    batch: int
    q_length: int
    kv_length: int

    # transformers takes a mask with four dimensions as one already prepared (generate prepares
    # them ahead for a static cache, then the model's forward hands them to the mask function)
    ndim = 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, 1, self.q_length, self.kv_length)


@dataclass(frozen=True)
class _Grid:
    """The score grid a mask is built for, and where its keys and queries start in HF's count."""

    B: int
    T: int
    S: int
    hf_q_offset: int
    kv_offset: int
    device: torch.device | str
    use_vmap: bool

    @property
    def q_offset(self) -> int:  # the first query's position among the keys dikkat is given
        return self.hf_q_offset - self.kv_offset


def hf_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | HFMask | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> HFMask:
    """The mask function ``dikkat.hf.register`` gives ``AttentionMaskInterface``: the arguments
    of ``transformers.masking_utils.sdpa_mask`` in, an :class:`HFMask` out (never None, so that a
    layer receiving None knows no mask function ran). An encoder-decoder's cross-attention mask
    comes through here too (``create_bidirectional_mask`` with the encoder's states:
    ``kv_length`` the encoder's length, the bidirectional predicate): the encoder's padding
    alone, never causal."""
    from transformers.masking_utils import causal_mask_function  # optional dependency

    if isinstance(attention_mask, HFMask):  # prepared ahead (generate, static cache): as it is
        if attention_mask.shape[2:] != (q_length, kv_length):
            raise ValueError(
                f"a prepared mask of shape {attention_mask.shape} cannot serve (T, S) = "
                f"{(q_length, kv_length)}"
            )
        return attention_mask
    hf_q_offset = int(q_offset)  # a static cache passes a 0-d tensor
    if hf_q_offset < kv_offset:
        raise ValueError(
            f"q_offset={hf_q_offset} is before kv_offset={kv_offset}: the queries would precede "
            "every key"
        )
    grid = _Grid(batch_size, q_length, kv_length, hf_q_offset, kv_offset, device, use_vmap)
    mask = _convert(causal_mask_function if mask_function is None else mask_function, grid)
    if attention_mask is not None:
        mask = _and(mask, _padding(attention_mask, grid))
    return HFMask(
        mask=None if isinstance(mask, Full) else mask,
        q_offset=grid.q_offset,
        batch=batch_size,
        q_length=q_length,
        kv_length=kv_length,
    )


# --- the tree of predicates -----------------------------------------------------------------------


def _name(fn: Callable) -> str | None:
    """The qualified name of one of transformers' mask builders, None for anything else."""
    if getattr(fn, "__module__", None) != _HF:
        return None
    return getattr(fn, "__qualname__", None)


def _captured(fn: Callable) -> dict[str, Any]:
    """The variables a closure of transformers' keeps (its parameters: window, chunk, tensors)."""
    cells = fn.__closure__ or ()  # type: ignore[attr-defined]
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells), strict=True))  # type: ignore[attr-defined]


def _convert(fn: Callable, grid: _Grid) -> Mask:
    name = _name(fn)
    if name == "causal_mask_function":
        return masks.causal()
    if name == "bidirectional_mask_function":
        return masks.full()
    if name == "and_masks.<locals>.and_mask":
        return _convert_and(list(_captured(fn)["mask_functions"]), grid)
    if name == "or_masks.<locals>.or_mask":
        parts = [_convert(f, grid) for f in _captured(fn)["mask_functions"]]
        out = parts[0]
        for part in parts[1:]:
            out = out | part
        return out
    if name == "padding_mask_function.<locals>.inner_mask":
        return _padding(_captured(fn)["padding_mask"], grid)
    if name == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        w = int(_captured(fn)["sliding_window"])  # |q − kv| ≤ w: w keys back, w ahead
        return masks.sliding_window(w + 1, ahead=w)
    return _dense(fn, grid)


def _convert_and(fns: list[Callable], grid: _Grid) -> Mask:
    """An intersection. The causal predicate turns the overlays that come with it — a sliding
    window, chunks, packed sequences — into dikkat's causal shapes (each causal already)."""
    names = [_name(f) for f in fns]
    causal = "causal_mask_function" in names
    parts: list[Mask] = []
    rest: list[Callable] = []
    for fn, name in zip(fns, names, strict=True):
        if causal and name == "sliding_window_overlay.<locals>.inner_mask":
            parts.append(masks.sliding_window(int(_captured(fn)["sliding_window"])))
        elif causal and name == "chunked_overlay.<locals>.inner_mask":
            parts.append(_chunks(fn, grid))
        elif name != "causal_mask_function":
            rest.append(fn)
    packed = _packed(rest, grid)
    if packed is not None:
        parts.append(packed[0])
        rest = packed[1]
    if causal and not parts:
        parts.append(masks.causal())
    out: Mask = masks.full()
    for part in [*parts, *(_convert(f, grid) for f in rest)]:
        out = _and(out, part)
    return out


def _and(a: Mask, b: Mask) -> Mask:
    if isinstance(a, Full):
        return b
    return a if isinstance(b, Full) else a & b


# --- the shapes -----------------------------------------------------------------------------------


def _chunks(fn: Callable, grid: _Grid) -> Mask:
    """``chunked_overlay`` & causal (Llama 4): chunks of ``chunk_size`` keys counted from each
    sequence's first real token — causal attention within a chunk, which is dikkat's
    :func:`~dikkat.masks.document` with the chunk number as document id."""
    captured = _captured(fn)
    size, left = int(captured["chunk_size"]), captured["left_padding"]
    n = max(grid.q_offset + grid.T, grid.S)
    position = torch.arange(n, device=left.device) + grid.kv_offset  # HF's count
    ids = torch.div(position[None, :] - left.view(-1, 1), size, rounding_mode="floor")
    return masks.document(ids)


def _packed(fns: list[Callable], grid: _Grid) -> tuple[Mask, list[Callable]] | None:
    """Packed sequences without a cache: HF intersects ``packed_sequence_mask_function`` with the
    base mask evaluated on each token's position id. Within one packed sequence the ids run up
    by one, so a causal or sliding base means the same on them as on the token indices: the pair
    is the base mask within each sequence, i.e. dikkat's document mask (and the window)."""
    names = [_name(f) for f in fns]
    try:
        i = names.index("packed_sequence_mask_function.<locals>.inner_mask")
        j = names.index("remap_positions_for_packed_sequence.<locals>.inner_mask")
    except ValueError:
        return None
    ids = _captured(fns[i])["packed_sequence_mask"]
    remapped = _captured(fns[j])
    base = _convert(remapped["mask_function"], grid)
    if grid.kv_offset or grid.hf_q_offset or not _is_causal_shape(base):
        return None
    if not torch.equal(ids, _runs(remapped["position_ids"])):
        return None  # sequences that are not the runs of the position ids: evaluate densely
    mask = masks.document(ids) if isinstance(base, Causal) else base & masks.document(ids)
    return mask, [f for k, f in enumerate(fns) if k not in (i, j)]


def _is_causal_shape(mask: Mask) -> bool:
    return isinstance(mask, (Causal, SlidingWindow))


def _runs(position_ids: Tensor) -> Tensor:
    """Which packed sequence each token is in: a new one wherever the position does not go up by
    one (as ``masking_utils.find_packed_sequence_indices`` counts them)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def _padding(attention_mask: Tensor, grid: _Grid) -> Mask:
    """HF's 2-D padding mask (B, past + T), True = real token, cut to the keys dikkat is given.
    Right padding becomes per-row lengths (whose ``kv_range`` bounds the keys), any other
    layout the per-key flags."""
    valid = attention_mask.to(torch.bool)
    needed = grid.kv_offset + grid.S
    if valid.dim() != 2:
        raise ValueError(
            f"attention_mask must be a 2-D (B, keys) padding mask here, got shape "
            f"{tuple(valid.shape)}"
        )
    if valid.shape[1] < needed:  # padded with False, as masking_utils.prepare_padding_mask does
        valid = torch.nn.functional.pad(valid, (0, needed - valid.shape[1]))
    valid = valid[:, grid.kv_offset : needed]
    if tracing():  # no host read of the flags here: they stay per-key (exact, fewer skips)
        return masks.padding(valid=valid)
    if bool(valid.all()):
        return masks.full()
    lengths = valid.sum(-1)
    if torch.equal(valid, torch.arange(grid.S, device=valid.device) < lengths[:, None]):
        return masks.padding(lengths)
    return masks.padding(valid=valid)


def _dense(fn: Callable, grid: _Grid) -> Mask:
    """A predicate dikkat does not know, evaluated by transformers itself on the (B, 1, T, S)
    grid (vmapped where transformers would vmap it), kept as a bool tensor."""
    from transformers.masking_utils import sdpa_mask  # optional dependency

    tensor = sdpa_mask(
        batch_size=grid.B,
        q_length=grid.T,
        kv_length=grid.S,
        q_offset=grid.hf_q_offset,
        kv_offset=grid.kv_offset,
        mask_function=fn,
        attention_mask=None,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=grid.use_vmap,
        device=grid.device,
    )
    return masks.dense(tensor, q_offset=grid.q_offset)
