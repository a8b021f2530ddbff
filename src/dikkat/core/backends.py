"""What a backend is, and dikkat's own: reference, sdpa, tiled, flex, triton and linear.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (G divides H), ``T`` query
length, ``S`` key length, ``D`` head dim, ``Dv`` value head dim.

A backend is a function ``run(request) -> (out, weights | None, lse | None)`` with a
``supports(request)`` that returns None when it can serve the request and otherwise the reason it
cannot, and optionally an ``avoid(request)``: the reason ``auto`` passes it by although it could
serve. The registry, ``auto`` and the NaN rule around every backend are in
:mod:`dikkat.core.attention`; the numbers ``auto``'s reasons rest on in :mod:`dikkat.core.tuning`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core import flex, tuning
from dikkat.core.checks import AttentionShape
from dikkat.core.linear import linear_attention
from dikkat.core.masks import Mask
from dikkat.core.reference import reference_attention
from dikkat.core.sdpa import sdpa_attention
from dikkat.core.tiled import BLOCK, tiled_attention
from dikkat.core.triton import triton_attention, triton_decode
from dikkat.core.triton import unsupported as triton_unsupported

__all__ = ["BUILTIN", "AttentionRequest", "Backend", "visible_fraction"]


@dataclass(frozen=True)
class AttentionRequest:
    """One validated attention call, as every backend receives it."""

    q: Tensor  # (B, H, T, D)
    k: Tensor  # (B, G, S, D); keys shared by the batch arrive as a stride-0 view of (1, G, S, D)
    v: Tensor  # (B, G, S, Dv), likewise
    mask: Mask | None  # True = may attend; None = every key
    bias: Tensor | None  # additive, broadcastable to (B, H, T, S)
    scale: float
    q_offset: int  # absolute position of query 0 (decoding with a cache; < 0: before key 0)
    dropout: float
    return_weights: bool
    shape: AttentionShape
    return_lse: bool = False  # also the log-sum-exp of each row's scores (B, H, T), fp32
    softcap: float | None = None  # scaled scores s become softcap · tanh(s / softcap)
    # attention sinks (B|1, H|1, T|1), fp32 (fp64 for fp64 q): one more logit per row in the
    # softmax's denominator, with no value; only a backend with sinks=True receives them
    sinks: Tensor | None = None


@dataclass(frozen=True)
class Backend:
    """A named attention implementation."""

    name: str
    run: Callable[[AttentionRequest], tuple[Tensor, Tensor | None, Tensor | None]]
    supports: Callable[[AttentionRequest], str | None]
    doc: str
    # auto passes this backend by (though it could serve) when this returns a reason
    avoid: Callable[[AttentionRequest], str | None] | None = None
    exact: bool = True  # computes softmax attention (checked against the reference)
    # for explain: a sentence when auto's verdict on this backend depends on the state of the
    # process (what it has compiled), else None
    note: Callable[[AttentionRequest], str | None] | None = None
    # False for a backend that checks its inputs' finiteness itself: one whose call is a
    # collective (dikkat.distributed's ring) must not be run again by one process alone
    finite_rule: bool = True
    # honours AttentionRequest.sinks; dikkat.attention refuses sinks= for a backend without,
    # before its supports is asked, so that no backend can drop them unawares
    sinks: bool = False


# --- reference -----------------------------------------------------------------------------------


def _run_reference(r: AttentionRequest) -> tuple[Tensor, Tensor | None, Tensor | None]:
    out, aux = reference_attention(
        r.q,
        r.k,
        r.v,
        r.mask,
        scale=r.scale,
        bias=r.bias,
        q_offset=r.q_offset,
        dropout=r.dropout,
        return_lse=r.return_lse,
        softcap=r.softcap,
        sinks=r.sinks,
    )
    return out, aux.weights, aux.lse


REFERENCE = Backend(
    "reference",
    _run_reference,
    lambda r: None,
    "the formula of Vaswani et al. 2017, full (B, H, T, S) score matrix, returns weights",
    sinks=True,
)


# --- sdpa ----------------------------------------------------------------------------------------


def _run_sdpa(r: AttentionRequest) -> tuple[Tensor, None, None]:
    out = sdpa_attention(
        r.q, r.k, r.v, r.mask, scale=r.scale, bias=r.bias, q_offset=r.q_offset, dropout=r.dropout
    )
    return out, None, None


# the reason given by the backends whose kernels take no score modifier
NO_SOFTCAP = "it cannot soft-cap the scores (softcap=)"


def _sdpa_supports(r: AttentionRequest) -> str | None:
    if r.softcap is not None:
        return NO_SOFTCAP + ": PyTorch's fused kernels take no score modifier"
    if r.return_weights:
        return "it cannot return the weights"
    if r.return_lse:
        return "it cannot return the log-sum-exp"
    return None


def visible_fraction(mask: Mask, T: int, S: int, q_offset: int = 0, block: int = BLOCK) -> float:
    """The fraction of the T × S score cells inside the key ranges the mask reports per block of
    queries (an upper bound on what it lets through)."""
    seen = 0
    for q0 in range(0, T, block):
        q1 = min(q0 + block, T)
        lo, hi = mask.kv_range(q0 + q_offset, q1 + q_offset, S)
        seen += (q1 - q0) * max(0, hi - lo)
    return seen / (T * S)


def _sdpa_avoid(r: AttentionRequest) -> str | None:
    """With a mask that hides most score cells, SDPA computes them all (through a dense mask)
    while the tiled backend never visits them: on large calls auto prefers the tiled one (where
    the line lies is the device's: :mod:`dikkat.core.tuning`). On CUDA a mask other than causal
    is one SDPA's flash kernel cannot take (it falls back to a kernel reading a dense mask):
    auto prefers the triton backend there, which skips the blocks the mask hides."""
    if _prefers_triton(r):
        if _is_decode(r):
            return "a decoding step over a long cache, which triton's split-K kernel spreads out"
        return "its fused kernels take no mask but causal, and triton skips the masked blocks"
    tune = tuning.for_device(r.q.device)
    cells = r.shape.T * r.shape.S
    if r.mask is None or r.mask.is_causal or cells < tune.sdpa_avoid_min_cells:
        return None
    if _tiled_supports(r) is not None:
        return None
    fraction = visible_fraction(r.mask, r.shape.T, r.shape.S, r.q_offset)
    if fraction > tune.sdpa_avoid_max_visible:
        return None
    return f"the mask leaves at most {fraction:.0%} of the score cells, which tiled alone skips"


SDPA = Backend(
    "sdpa",
    _run_sdpa,
    _sdpa_supports,
    "torch.nn.functional.scaled_dot_product_attention (fused kernels; masks made dense)",
    avoid=_sdpa_avoid,
)


# --- tiled ---------------------------------------------------------------------------------------


def _run_tiled(r: AttentionRequest) -> tuple[Tensor, None, Tensor]:
    out, lse = tiled_attention(
        r.q, r.k, r.v, r.mask, scale=r.scale, softcap=r.softcap, bias=r.bias, q_offset=r.q_offset,
        sinks=r.sinks,
    )  # fmt: skip
    return out, None, lse


def _tiled_supports(r: AttentionRequest) -> str | None:
    if r.return_weights:
        return "it never holds the full weights (use return_lse)"
    if r.dropout > 0:
        return "it has no dropout"
    return None


TILED = Backend(
    "tiled",
    _run_tiled,
    _tiled_supports,
    "exact attention over tiles with the online softmax: O(n) memory, masked tiles skipped",
    sinks=True,
)


# --- triton --------------------------------------------------------------------------------------


# A call of at most this many queries over at least this many keys is a decoding step: the
# split-K kernel (flash-decoding) spreads its keys over the GPU, where the main kernel would run
# only B·H programs of one query block each. Not timed: design bounds, like the block sizes in
# dikkat.core.triton.launch (benchmarks/gpu.py times decoding on a 32k cache).
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 1024


def _is_decode(r: AttentionRequest) -> bool:
    """A few queries over a long cache, needing no gradient and no bias: flash-decoding's case."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v))
    return (
        r.shape.T <= DECODE_MAX_QUERIES
        and r.shape.S >= DECODE_MIN_KEYS
        and r.bias is None
        and not grad
    )


def _run_triton(r: AttentionRequest) -> tuple[Tensor, None, Tensor]:
    if _is_decode(r):
        out, lse = triton_decode(r.q, r.k, r.v, r.mask, scale=r.scale, q_offset=r.q_offset)
    else:
        out, lse = triton_attention(
            r.q, r.k, r.v, r.mask, scale=r.scale, bias=r.bias, q_offset=r.q_offset
        )
    return out, None, lse


def _triton_supports(r: AttentionRequest) -> str | None:
    if r.return_weights:
        return "it never holds the full weights (use return_lse)"
    if r.dropout > 0:
        return "it has no dropout"
    if r.softcap is not None:
        return NO_SOFTCAP + ": its kernels take no score modifier"
    return triton_unsupported(r.q, r.bias, r.shape.D, r.shape.Dv)


def _triton_avoid(r: AttentionRequest) -> str | None:
    if r.q.device.type != "cuda":
        return "off CUDA it runs in triton's interpreter, which is for tests (numpy, slow)"
    return None


def _prefers_triton(r: AttentionRequest) -> bool:
    """Whether auto takes triton before SDPA: on CUDA, for a mask SDPA's flash kernel cannot take,
    and for a decoding step over a long cache (:func:`_is_decode`).
    Unmasked and causal calls stay SDPA's, whose flash kernel (FlashAttention-2 in PyTorch) is
    tuned per GPU while these kernels have not been timed on one (docs/attention.md, "The
    triton backend")."""
    decoding = _is_decode(r)  # SDPA's flash kernel runs one program per (batch, head) there
    if not decoding and (r.mask is None or r.mask.is_causal or r.mask.is_full):
        return False
    return _triton_supports(r) is None and _triton_avoid(r) is None


TRITON = Backend(
    "triton",
    _run_triton,
    _triton_supports,
    "FlashAttention-2 in Triton kernels: masked blocks skipped, lse saved (CUDA; optional triton)",
    avoid=_triton_avoid,
)


# --- flex ----------------------------------------------------------------------------------------


def _run_flex(r: AttentionRequest) -> tuple[Tensor, None, Tensor | None]:
    out, lse = flex.flex_attention(
        r.q, r.k, r.v, r.mask, scale=r.scale, bias=r.bias, q_offset=r.q_offset,
        return_lse=r.return_lse, softcap=r.softcap,
    )  # fmt: skip
    return out, None, lse


def _flex_supports(r: AttentionRequest) -> str | None:
    return flex.flex_supports(
        r.q, dropout=r.dropout, return_weights=r.return_weights, return_lse=r.return_lse,
        k=r.k, v=r.v, bias=r.bias,
    )  # fmt: skip


def _flex_verdict(r: AttentionRequest) -> tuple[str | None, str | None]:
    return flex.auto_verdict(
        r.q, r.k, r.v, r.mask, scale=r.scale, bias=r.bias, q_offset=r.q_offset,
        softcap=r.softcap,
    )  # fmt: skip


FLEX = Backend(
    "flex",
    _run_flex,
    _flex_supports,
    "torch's FlexAttention with a cached block mask (compiled; auto: only once compiled)",
    avoid=lambda r: _flex_verdict(r)[0],
    note=lambda r: _flex_verdict(r)[1],
)


# --- linear --------------------------------------------------------------------------------------


def _run_linear(r: AttentionRequest) -> tuple[Tensor, None, None]:
    return linear_attention(r.q, r.k, r.v, causal=r.mask is not None), None, None


def _linear_supports(r: AttentionRequest) -> str | None:
    if r.mask is not None and not r.mask.is_causal:
        return "linear attention takes no mask or causal() (other masks do not factorise)"
    if r.mask is not None and r.q_offset + r.shape.T != r.shape.S:
        return (
            f"causal linear attention needs the queries to be the last keys: q_offset + T = "
            f"{r.q_offset + r.shape.T}, S = {r.shape.S}"
        )
    if r.softcap is not None:
        return NO_SOFTCAP + ": linear attention forms no scores"
    for flag, what in (
        (r.bias is not None, "bias"),
        (r.dropout > 0, "dropout"),
        (r.return_weights, "weights"),
        (r.return_lse, "log-sum-exp"),
    ):
        if flag:
            return f"linear attention has no {what}"
    return None


LINEAR = Backend(
    "linear",
    _run_linear,
    _linear_supports,
    "linear attention, φ(x) = elu(x) + 1: another model, O(n); never chosen by auto",
    exact=False,
)

BUILTIN: tuple[Backend, ...] = (REFERENCE, SDPA, TILED, FLEX, TRITON, LINEAR)
