"""``dikkat.attention``: one signature, a small registry of backends, and ``auto`` dispatch.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (G divides H; G = H is plain
multi-head, G = 1 multi-query), ``T`` query length, ``S`` key length, ``D`` head dim.

A backend is a function ``run(request) -> (out, weights | None, lse | None)`` with a
``supports(request)`` that returns None when it can serve the request and otherwise the reason it
cannot. ``auto`` walks the backends in order of preference and takes the first that can.

NaN and infinity, one rule for every backend (linear attention included). Output row i *reaches*
its query q_i, each key/value row j that its mask allows, and each bias cell (i, j) that its mask
allows. A NaN or ±∞ in q, k or v, or a NaN or +∞ in the bias, makes exactly the rows that reach
it NaN (the whole row, and its weights and log-sum-exp when returned), and leaves every other row
as it would be without it: a masked NaN key, a NaN value row that only hidden queries could see, a
NaN query of another row change nothing. −∞ in the bias is no error but SDPA's additive-mask
convention: that key is hidden from that query (a row with every key hidden gives 0, like a fully
masked row). A NaN row is a constant: no gradient flows back through it, and the non-finite
entries themselves get gradient 0; every other row's gradient is the one it would have without
them. The cost when every input is finite is one reduction over q, k and the output per call,
and over v when autograd is on (:func:`dikkat.core.nonfinite.needs_exact_path`); only when one
finds a non-finite value does the exact slow path run. (Inside ``torch.compile``, where a graph
cannot branch on values, the check is skipped and the kernel's own behaviour stands.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core import flex
from dikkat.core.checks import (
    AttentionShape,
    check_bias,
    check_dropout,
    check_mask,
    check_qkv,
    check_scale,
)
from dikkat.core.linear import linear_attention
from dikkat.core.masks import Mask
from dikkat.core.nonfinite import (
    bias_finite_part,
    finite_part,
    needs_exact_path,
    poison_rows,
    reached_rows,
)
from dikkat.core.reference import reference_attention
from dikkat.core.sdpa import sdpa_attention
from dikkat.core.tiled import tiled_attention

__all__ = [
    "AttentionRequest",
    "Backend",
    "attention",
    "available_backends",
    "check_backend_name",
    "explain",
    "register_backend",
]


@dataclass(frozen=True)
class AttentionRequest:
    """One validated attention call, as every backend receives it."""

    q: Tensor  # (B, H, T, D)
    k: Tensor  # (B, G, S, D)
    v: Tensor  # (B, G, S, Dv)
    mask: Mask | None  # True = may attend; None = every key
    bias: Tensor | None  # additive, broadcastable to (B, H, T, S)
    scale: float
    q_offset: int  # absolute position of query 0 (decoding with a cache)
    dropout: float
    return_weights: bool
    shape: AttentionShape
    return_lse: bool = False  # also the log-sum-exp of each row's scores (B, H, T), fp32


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


_BACKENDS: dict[str, Backend] = {}
# Preference order for "auto": fastest first; the reference can serve everything, so it is last.
_AUTO_ORDER: list[str] = []


def register_backend(backend: Backend, *, auto_rank: int | None = None) -> None:
    """Add a backend (or replace the one of that name); ``auto_rank`` is its place in auto's
    preference list, 0 first (None: never auto; past the end: last)."""
    _check_backend(backend)
    if auto_rank is not None:
        if isinstance(auto_rank, bool) or not isinstance(auto_rank, int):
            raise TypeError(f"auto_rank must be an int or None, got {type(auto_rank).__name__}")
        if auto_rank < 0:
            raise ValueError(
                f"auto_rank must be non-negative (0 = auto's first choice), got {auto_rank}"
            )
    _BACKENDS[backend.name] = backend
    if backend.name in _AUTO_ORDER:
        _AUTO_ORDER.remove(backend.name)
    if auto_rank is not None:
        _AUTO_ORDER.insert(auto_rank, backend.name)


def _check_backend(backend: Backend) -> None:
    if not isinstance(backend, Backend):
        raise TypeError(
            f"backend must be a dikkat Backend(name, run, supports, doc), got "
            f"{type(backend).__name__}"
        )
    if not isinstance(backend.name, str) or not backend.name:
        raise TypeError(f"backend name must be a non-empty str, got {backend.name!r}")
    if backend.name == "auto":
        raise ValueError("backend name 'auto' is taken: it means dikkat's own choice")
    for field in ("run", "supports"):
        if not callable(getattr(backend, field)):
            raise TypeError(
                f"backend {backend.name!r}: {field} must be callable, got "
                f"{type(getattr(backend, field)).__name__}"
            )
    if backend.avoid is not None and not callable(backend.avoid):
        raise TypeError(
            f"backend {backend.name!r}: avoid must be callable or None, got "
            f"{type(backend.avoid).__name__}"
        )


def check_backend_name(name: str, value: object, *, exact_only: bool = False) -> str:
    """``value`` is ``"auto"`` or a registered backend (``exact_only``: one computing softmax
    attention); for layers that take a backend name, so that a typo fails where it is given."""
    choices = ("auto", *available_backends(exact_only=exact_only))
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value  # type: ignore[return-value]


def available_backends(*, exact_only: bool = False) -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``); ``exact_only``: only those computing
    softmax attention (not ``"linear"``, which is another model)."""
    return sorted(name for name, b in _BACKENDS.items() if b.exact or not exact_only)


def _choose(request: AttentionRequest) -> tuple[Backend, str]:
    refused = []
    for name in _AUTO_ORDER:
        backend = _BACKENDS[name]
        reason = backend.supports(request)
        if reason is None and backend.avoid is not None:
            reason = backend.avoid(request)
        if reason is None:
            why = "; ".join(refused) if refused else "the first choice"
            return _BACKENDS[name], why
        refused.append(f"not {name}: {reason}")
    raise RuntimeError("no attention backend can serve this request: " + "; ".join(refused))


def _request(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None,
    scale: float | None,
    bias: Tensor | None,
    q_offset: int,
    dropout: float,
    return_weights: bool,
    return_lse: bool = False,
) -> AttentionRequest:
    shape = check_qkv(q, k, v)
    return AttentionRequest(
        q=q,
        k=k,
        v=v,
        mask=check_mask(mask, shape, q_offset),
        bias=check_bias(bias, q, shape),
        scale=check_scale(scale, shape.D),
        q_offset=q_offset,
        dropout=check_dropout(dropout),
        return_weights=bool(return_weights),
        shape=shape,
        return_lse=bool(return_lse),
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    scale: float | None = None,
    bias: Tensor | None = None,
    q_offset: int = 0,
    dropout: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale + bias) V`` over the allowed keys.

    Args:
        q: queries (B, H, T, D).
        k: keys (B, G, S, D); G must divide H (grouped-query attention; G = H is multi-head).
        v: values (B, G, S, Dv).
        mask: a :mod:`dikkat.masks` mask or a bool tensor broadcastable to (B, H, T, S);
            **True = may attend**. A row with no allowed key gives output 0.
        scale: multiplies the scores; default 1/√D.
        bias: additive float scores broadcastable to (B, H, T, S) (e.g. ALiBi).
        q_offset: absolute position of the first query, for masks when decoding with a cache.
        dropout: dropout probability on the weights (pass 0 at evaluation).
        backend: ``"auto"`` or one of :func:`available_backends`.
        return_weights: also return the weights (B, H, T, S).
        return_lse: also return the log-sum-exp of each row's scores (B, H, T) in fp32
            (−inf for a row with no allowed key); the weights are exp(score − lse).

    Returns:
        The output (B, H, T, Dv), followed by the weights and/or the lse when requested.

    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> attention(q, k, v, dikkat.masks.causal()).shape
    torch.Size([1, 2, 4, 8])
    """
    request = _request(q, k, v, mask, scale, bias, q_offset, dropout, return_weights, return_lse)
    if backend == "auto":
        chosen, _ = _choose(request)
    elif backend in _BACKENDS:
        chosen = _BACKENDS[backend]
        reason = chosen.supports(request)
        if reason is not None:
            raise ValueError(f"backend {backend!r} cannot serve this call: {reason}")
    else:
        raise ValueError(
            f"unknown backend {backend!r}; choose 'auto' or one of {available_backends()}"
        )
    out, weights, lse = _run_finite_rule(chosen, request)
    extra = ((weights,) if return_weights else ()) + ((lse,) if return_lse else ())
    return (out, *extra) if extra else out


def _run_finite_rule(
    backend: Backend, r: AttentionRequest
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Run the backend under the module's NaN/∞ rule: as it is when every input is finite, else
    on the finite part of the inputs, with the rows that reach a non-finite value set to NaN."""
    out, weights, lse = backend.run(r)
    inputs = (r.q, r.k, r.v) if r.bias is None else (r.q, r.k, r.v, r.bias)
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if not needs_exact_path(r.q, r.k, r.v, out, backward=backward):
        return out, weights, lse
    reached = reached_rows(r.q, r.k, r.v, r.bias, r.mask, r.q_offset)  # (B, H, T)
    clean = dataclasses.replace(
        r,
        q=finite_part(r.q),
        k=finite_part(r.k),
        v=finite_part(r.v),
        bias=None if r.bias is None else bias_finite_part(r.bias),
    )
    out, weights, lse = backend.run(clean)
    return poison_rows(out, reached), poison_rows(weights, reached), poison_rows(lse, reached)


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    bias: Tensor | None = None,
    q_offset: int = 0,
    return_weights: bool = False,
) -> str:
    """Say which backend ``auto`` would pick for this call, and why."""
    request = _request(q, k, v, mask, None, bias, q_offset, 0.0, return_weights)
    chosen, why = _choose(request)
    return f"{chosen.name} ({why}): {chosen.doc}"


# --- the built-in backends ------------------------------------------------------------------------


def _run_reference(r: AttentionRequest) -> tuple[Tensor, Tensor, Tensor | None]:
    result = reference_attention(
        r.q,
        r.k,
        r.v,
        r.mask,
        scale=r.scale,
        bias=r.bias,
        q_offset=r.q_offset,
        dropout=r.dropout,
        return_lse=r.return_lse,
    )
    return (*result, None) if len(result) == 2 else result  # type: ignore[return-value]


def _run_sdpa(r: AttentionRequest) -> tuple[Tensor, None, None]:
    out = sdpa_attention(
        r.q, r.k, r.v, r.mask, scale=r.scale, bias=r.bias, q_offset=r.q_offset, dropout=r.dropout
    )
    return out, None, None


def _sdpa_supports(r: AttentionRequest) -> str | None:
    if r.return_weights:
        return "it cannot return the weights"
    if r.return_lse:
        return "it cannot return the log-sum-exp"
    return None


def visible_fraction(mask: Mask, T: int, S: int, q_offset: int = 0, block: int = 128) -> float:
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
    while the tiled backend never visits them: on large calls auto prefers the tiled one."""
    if r.mask is None or r.mask.is_causal or r.shape.T * r.shape.S < 1 << 20:
        return None
    if _tiled_supports(r) is not None:
        return None
    fraction = visible_fraction(r.mask, r.shape.T, r.shape.S, r.q_offset)
    if fraction > 0.25:
        return None
    return f"the mask leaves at most {fraction:.0%} of the score cells, which tiled alone skips"


def _run_tiled(r: AttentionRequest) -> tuple[Tensor, None, Tensor]:
    out, lse = tiled_attention(
        r.q, r.k, r.v, r.mask, scale=r.scale, bias=r.bias, q_offset=r.q_offset
    )
    return out, None, lse


def _tiled_supports(r: AttentionRequest) -> str | None:
    if r.return_weights:
        return "it never holds the full weights (use return_lse)"
    if r.dropout > 0:
        return "it has no dropout"
    return None


register_backend(
    Backend(
        "reference",
        _run_reference,
        lambda r: None,
        "the seed's formula, full (B, H, T, S) score matrix, returns weights",
    ),
    auto_rank=0,
)
register_backend(
    Backend(
        "sdpa",
        _run_sdpa,
        _sdpa_supports,
        "torch.nn.functional.scaled_dot_product_attention (fused kernels; masks made dense)",
        avoid=_sdpa_avoid,
    ),
    auto_rank=0,
)


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
    for flag, what in (
        (r.bias is not None, "bias"),
        (r.dropout > 0, "dropout"),
        (r.return_weights, "weights"),
        (r.return_lse, "log-sum-exp"),
    ):
        if flag:
            return f"linear attention has no {what}"
    return None


register_backend(
    Backend(
        "linear",
        _run_linear,
        _linear_supports,
        "linear attention, φ(x) = elu(x) + 1: another model, O(n); never chosen by auto",
        exact=False,
    ),
)
register_backend(
    Backend(
        "tiled",
        _run_tiled,
        _tiled_supports,
        "exact attention over tiles with the online softmax: O(n) memory, masked tiles skipped",
    ),
    auto_rank=1,  # after SDPA (faster when the scores fit), before the reference
)


def _run_flex(r: AttentionRequest) -> tuple[Tensor, None, Tensor | None]:
    out, lse = flex.flex_attention(
        r.q, r.k, r.v, r.mask, scale=r.scale, bias=r.bias, q_offset=r.q_offset,
        return_lse=r.return_lse,
    )  # fmt: skip
    return out, None, lse


def _flex_avoid(r: AttentionRequest) -> str | None:
    return flex.auto_avoid(r.q, r.k, r.v, r.mask, scale=r.scale, bias=r.bias, q_offset=r.q_offset)


register_backend(
    Backend(
        "flex",
        _run_flex,
        lambda r: flex.flex_supports(
            r.q, dropout=r.dropout, return_weights=r.return_weights, return_lse=r.return_lse
        ),
        "torch's FlexAttention with a cached block mask (compiled; auto: only once compiled)",
        avoid=_flex_avoid,
    ),
    auto_rank=1,  # after SDPA, before tiled; its `avoid` keeps auto from paying a compile
)
