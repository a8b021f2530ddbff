"""Input checks shared by every attention backend: errors name the argument and the shapes.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` query length, ``S`` key
length, ``D`` query/key head dim, ``Dv`` value head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.masks import Mask, as_mask
from dikkat.core.tracing import tracing


@dataclass(frozen=True)
class AttentionShape:
    """The sizes of one attention call, read off q (B, H, T, D), k (B, G, S, D), v (B, G, S, Dv)."""

    B: int
    H: int
    G: int
    T: int
    S: int
    D: int
    Dv: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.H // self.G


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> AttentionShape:
    """Validate q (B, H, T, D), k (B, G, S, D), v (B, G, S, Dv) and return their sizes; k and v
    may have batch size 1 instead of B (one set of keys and values for every sequence of the
    batch: a shared prefix, a shared memory), see :func:`broadcast_kv`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise ValueError(
                f"{name} is a nested tensor (layout {t.layout}); dikkat.attention takes dense "
                "(B, H, T, D) tensors: pack the sequences with dikkat.masks.document, or pass "
                "jagged q, k, v to dikkat.functional.scaled_dot_product_attention"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            layout = "(B, H, T, D)" if name == "q" else "(B, G, S, D)"
            raise ValueError(f"{name} must have 4 dims {layout}, got shape {_shape(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, T, D = q.shape
    if k.shape[0] != v.shape[0] or k.shape[0] not in (1, B):
        raise ValueError(
            f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (dim 0 is B; k and "
            f"v share one batch size, q's or 1 for keys and values shared by the whole batch)"
        )
    if k.shape[3] != D:
        raise ValueError(f"q has head dim {D} but k has {k.shape[3]}: q {_shape(q)}, k {_shape(k)}")
    if D == 0:
        raise ValueError(
            f"q and k have head dim D = 0; attention needs D ≥ 1: q {_shape(q)}, k {_shape(k)}"
        )
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k {_shape(k)} and v {_shape(v)} must agree on (G, S)")
    G, S = k.shape[1], k.shape[2]
    if G == 0 or H % G:
        raise ValueError(
            f"key has {G} heads, which does not divide the {H} query heads: "
            f"q {_shape(q)}, k {_shape(k)}"
        )
    return AttentionShape(B, H, G, T, S, D, v.shape[3])


def broadcast_kv(k: Tensor, B: int) -> Tensor:
    """k or v of batch size 1 as a (B, ·, ·, ·) view of itself (stride 0 along the batch, no
    copy); its gradient, through ``expand``, is the sum over the batch. Batch size B: k itself."""
    return k if k.shape[0] == B else k.expand(B, *k.shape[1:])


def check_scale(scale: float | None, D: int) -> float:
    """Default 1/√D (the 1/√d_k of Vaswani et al. 2017, eq. 1); else any finite number (0 gives
    every allowed key the same weight, a negative scale favours the least similar keys)."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_softcap(softcap: float | None) -> float | None:
    """None (no capping) or a positive finite number: the bound ``c`` of ``c · tanh(s / c)``."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be positive and finite (or None), got {softcap}")
    return float(softcap)


def check_mask(mask: Mask | Tensor | None, shape: AttentionShape, q_offset: int) -> Mask | None:
    """Wrap a tensor mask and check that the mask applies to the (B, H, T, S) scores."""
    if isinstance(q_offset, bool) or not isinstance(q_offset, int):
        raise ValueError(
            f"q_offset must be an int (the position of the first query among the keys; negative "
            f"when it sits before key 0), got {q_offset!r}"
        )
    m = as_mask(mask, q_offset)
    if m is not None:
        m.validate(shape.B, shape.H, shape.T, shape.S, q_offset)
        if m.is_full:
            return None  # nothing to mask
    return m


def bias_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype a bias is added to the scores in: fp32, or fp64 for fp64 queries — where every
    backend accumulates the scores. In bf16 an ALiBi bias of a few hundred would be rounded to
    steps of 2 (8 significant bits) before it is added; fp32 keeps 24."""
    return torch.promote_types(q_dtype, torch.float32)


def check_bias(bias: Tensor | None, q: Tensor, shape: AttentionShape) -> Tensor | None:
    """An additive float bias broadcastable to (B, H, T, S) (ALiBi, relative position terms),
    viewed as 4-D and cast to :func:`bias_dtype`: a bf16 or fp16 bias is widened exactly, an
    fp64 bias for fp32 (or narrower) queries is rounded to fp32 once, here."""
    if bias is None:
        return None
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias must be a float tensor, got dtype {bias.dtype}")
    target = (shape.B, shape.H, shape.T, shape.S)
    b4 = bias.view((1,) * max(0, 4 - bias.dim()) + _shape(bias))
    if b4.dim() != 4 or any(n not in (1, m) for n, m in zip(b4.shape, target, strict=True)):
        raise ValueError(
            f"bias of shape {_shape(bias)} does not broadcast to the (B, H, T, S) = {target} scores"
        )
    if bias.device != q.device:
        raise ValueError(f"bias is on {bias.device} but q is on {q.device}")
    return b4.to(bias_dtype(q.dtype))


def row_sinks(sinks: Tensor) -> Tensor:
    """Sinks (H,) — one per head — or 3-D (B|1, H|1, T|1) — one per head and query — as the 3-D
    view (B|1, H|1, T|1) that broadcasts against a row's log-sum-exp (B, H, T)."""
    return sinks.view(1, -1, 1) if sinks.dim() == 1 else sinks


def check_sinks(sinks: Tensor | None, q: Tensor, shape: AttentionShape) -> Tensor | None:
    """Attention sinks: one more logit per row in the softmax's denominator, with no value (the
    learned sinks of gpt-oss; docs/attention.md, "Attention sinks"). (H,) — one per query head —
    or 3-D broadcastable to (B, H, T) — one per head and query; finite. Returned as
    :func:`row_sinks`'s (B|1, H|1, T|1) view, cast to :func:`bias_dtype` (fp32 for bf16 q),
    where every backend keeps the softmax's statistics."""
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a tensor or None, got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a float tensor, got dtype {sinks.dtype}")
    target = (shape.B, shape.H, shape.T)
    if sinks.dim() == 1:
        fits = sinks.shape[0] == shape.H
    else:
        fits = sinks.dim() == 3 and all(
            n in (1, m) for n, m in zip(sinks.shape, target, strict=True)
        )
    if not fits:
        raise ValueError(
            f"sinks must have shape (H,) = ({shape.H},) — one logit per query head — or 3 dims "
            f"broadcastable to (B, H, T) = {target}, got {_shape(sinks)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}")
    if not tracing():  # a traced graph cannot branch on values, nor a vmapped call read them
        bad = int((~torch.isfinite(sinks.detach())).sum())
        if bad:
            raise ValueError(
                f"sinks must be finite: {bad} of the {sinks.numel()} entries of the sinks "
                f"{_shape(sinks)} are NaN or ±inf"
            )
    return row_sinks(sinks).to(bias_dtype(q.dtype))


def check_dropout(dropout: float) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float, got {type(dropout).__name__}")
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"dropout must be in [0, 1], got {dropout}")
    return float(dropout)


def check_flag(name: str, value: object) -> bool:
    """A real ``bool`` (not 0/1, not a string): a flag that decides what a call returns."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def dense_mask(
    mask: Mask | None, shape: AttentionShape, q_offset: int, device: torch.device
) -> Tensor | None:
    """The mask as a bool tensor broadcastable to (B, H, T, S), or None."""
    if mask is None:
        return None
    return mask.materialize(shape.B, shape.H, shape.T, shape.S, q_offset, device)
