"""``dikkat.attention``: one signature, a small registry of backends, and ``auto`` dispatch.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (G divides H; G = H is plain
multi-head, G = 1 multi-query), ``T`` query length, ``S`` key length, ``D`` head dim.

A backend (:class:`~dikkat.core.backends.Backend`) is a function ``run(request) -> (out,
weights | None, lse | None)`` with a ``supports(request)`` that returns None when it can serve
the request and otherwise the reason it cannot. ``auto`` walks the backends in order of
preference (:data:`AUTO_ORDER`, then where ``register_backend`` puts others) and takes the first
that can and has no reason to pass it by; :func:`explain` says which and why. Attention sinks
reach only a backend that declares it honours them (``Backend.sinks``): for any other,
``sinks=`` is refused before its ``supports`` is asked, so none can drop them unawares.

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
finds a non-finite value does the exact slow path run. (Inside ``torch.compile``, ``torch.export``
or a ``torch.func`` transform, where values cannot reach Python, a non-finite input is an error
instead: :func:`dikkat.core.nonfinite.check_traced`.)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dikkat.core.backends import BUILTIN, AttentionRequest, Backend
from dikkat.core.capture import capture_target, record
from dikkat.core.checks import (
    broadcast_kv,
    check_bias,
    check_dropout,
    check_flag,
    check_mask,
    check_qkv,
    check_scale,
    check_sinks,
    check_softcap,
)
from dikkat.core.masks import Mask
from dikkat.core.nonfinite import (
    bias_finite_part,
    check_traced,
    finite_part,
    needs_exact_path,
    poison_rows,
    reached_rows,
)
from dikkat.core.outputs import AttentionAux
from dikkat.core.tracing import tracing

__all__ = [
    "AUTO_ORDER",
    "AttentionAux",
    "AttentionRequest",
    "Backend",
    "attention",
    "auto_order",
    "available_backends",
    "check_backend_name",
    "explain",
    "register_backend",
]

# auto's preference among the built-in backends, first choice first:
AUTO_ORDER: tuple[str, ...] = (
    "sdpa",  # PyTorch's fused kernels: fastest where the scores fit, unless the mask hides most
    # Triton kernels on CUDA, for the masks SDPA's flash kernel cannot take (SDPA steps aside
    # for it) and the calls SDPA cannot serve (the lse); never its CPU interpreter
    "triton",
    "flex",  # compiled FlexAttention: only for a signature already compiled (never a compile)
    "tiled",  # exact in O(n) memory, skipping what the mask hides
    "reference",  # serves everything (the weights too), so it is last
)  # "linear" is another model: never auto

_BACKENDS: dict[str, Backend] = {}
_auto: list[str] = []  # auto's order now: AUTO_ORDER, then where register_backend put others


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
    if backend.name in _auto:
        _auto.remove(backend.name)
    if auto_rank is not None:
        _auto.insert(auto_rank, backend.name)


def auto_order() -> tuple[str, ...]:
    """The backends ``auto`` tries, first choice first: :data:`AUTO_ORDER` as
    :func:`register_backend` has changed it."""
    return tuple(_auto)


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
    for field in ("avoid", "note"):
        value = getattr(backend, field)
        if value is not None and not callable(value):
            raise TypeError(
                f"backend {backend.name!r}: {field} must be callable or None, got "
                f"{type(value).__name__}"
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


# why a backend without Backend.sinks cannot serve a call with sinks=
NO_SINKS = "it cannot add attention sinks (sinks=)"


def _refusal(backend: Backend, request: AttentionRequest) -> str | None:
    """Why ``backend`` cannot serve ``request``, or None: its own ``supports``, after the
    capabilities every backend declares (``Backend.sinks``)."""
    if request.sinks is not None and not backend.sinks:
        return NO_SINKS
    return backend.supports(request)


def _choose(request: AttentionRequest) -> tuple[Backend, list[tuple[str, str]]]:
    """auto's choice, and the backends it passed by on the way with the reason for each."""
    refused = []
    for name in _auto:
        backend = _BACKENDS[name]
        reason = _refusal(backend, request)
        if reason is None and backend.avoid is not None:
            reason = backend.avoid(request)
        if reason is None:
            return backend, refused
        refused.append((name, reason))
    reasons = "; ".join(f"not {name}: {reason}" for name, reason in refused)
    raise RuntimeError("no attention backend can serve this request: " + reasons)


for _builtin in BUILTIN:
    register_backend(_builtin)
_auto.extend(AUTO_ORDER)


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
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> AttentionRequest:
    shape = check_qkv(q, k, v)
    return AttentionRequest(
        q=q,
        k=broadcast_kv(k, shape.B),  # every backend sees (B, G, S, ·): views, never copies
        v=broadcast_kv(v, shape.B),
        mask=check_mask(mask, shape, q_offset),
        bias=check_bias(bias, q, shape),
        scale=check_scale(scale, shape.D),
        q_offset=q_offset,
        dropout=check_dropout(dropout),
        return_weights=check_flag("return_weights", return_weights),
        shape=shape,
        return_lse=check_flag("return_lse", return_lse),
        softcap=check_softcap(softcap),
        sinks=check_sinks(sinks, q, shape),
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    bias: Tensor | None = None,
    sinks: Tensor | None = None,
    q_offset: int = 0,
    dropout: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, AttentionAux]:
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale + bias) V`` over the allowed keys;
    with ``softcap`` c, ``softmax(c · tanh(Q Kᵀ · scale / c) + bias) V``.

    Args:
        q: queries (B, H, T, D).
        k: keys (B, G, S, D); G must divide H (grouped-query attention; G = H is multi-head).
            Batch size 1 instead of B shares one set of keys among all B sequences (a shared
            prefix or memory): broadcast as a view, its gradient summed over the batch.
        v: values (B, G, S, Dv), with k's batch size.
        mask: a :mod:`dikkat.masks` mask or a bool tensor broadcastable to (B, H, T, S);
            **True = may attend**. A row with no allowed key gives output 0.
        scale: multiplies the scores; default 1/√D.
        softcap: logit soft-capping (Gemma 2): a positive c bounds the scaled scores s to
            (−c, c) as ``c · tanh(s / c)``, before the bias and the mask; None: no capping.
            The reference, tiled and flex backends can; sdpa, triton and linear refuse
            (docs/attention.md, "Soft-capping").
        bias: additive float scores broadcastable to (B, H, T, S) (e.g. ALiBi).
        sinks: attention sinks (gpt-oss): a finite float tensor (H,), one logit per query head,
            or 3-D broadcastable to (B, H, T), one per head and query. Each row's softmax gets
            the sink as one more score with no value: it adds exp(sink) to the denominator
            only, so the weights sum to less than 1 and a row with no allowed key puts all its
            weight on the sink (output 0). Differentiable. The reference and tiled backends
            can; the others refuse (docs/attention.md, "Attention sinks").
        q_offset: absolute position of the first query among the keys, for masks: S − T aligns
            the queries with the last keys (bottom-right causal, a decoding step); negative
            when T > S puts the first queries before key 0, where causal() and
            sliding_window() let them see nothing (docs/attention.md, "Causal masks when
            T ≠ S").
        dropout: dropout probability on the weights (pass 0 at evaluation).
        backend: ``"auto"`` or one of :func:`available_backends`.
        return_weights: also return the weights (B, H, T, S) (only the reference backend
            holds them; ``auto`` then picks it).
        return_lse: also return the log-sum-exp of each row's scores (B, H, T) in fp32
            (−inf for a row with no allowed key); the weights are exp(score − lse).

    Returns:
        ``out`` (B, H, T, Dv) when neither flag is set; otherwise ``(out, aux)``, ``aux`` an
        :class:`~dikkat.core.outputs.AttentionAux` ``(weights, lse)`` whose field not asked
        for is None (docs/attention.md, "What attention returns").

    >>> import dikkat
    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> attention(q, k, v, dikkat.masks.causal()).shape
    torch.Size([1, 2, 4, 8])
    >>> out, (weights, lse) = attention(q, k, v, return_weights=True)
    >>> weights.shape, lse is None
    (torch.Size([1, 2, 4, 4]), True)
    """
    request = _request(
        q, k, v, mask, scale, bias, q_offset, dropout, return_weights, return_lse, softcap, sinks
    )
    if backend == "auto":
        chosen, _ = _choose(request)
    elif backend in _BACKENDS:
        chosen = _BACKENDS[backend]
        reason = _refusal(chosen, request)
        if reason is not None:
            raise ValueError(f"backend {backend!r} cannot serve this call: {reason}")
    else:
        raise ValueError(
            f"unknown backend {backend!r}; choose 'auto' or one of {available_backends()}"
        )
    target = capture_target()  # inside a layer dikkat.capture selected
    if target is None:
        out, weights, lse = _run_finite_rule(chosen, request)
    else:  # the same backend, asked for the lse when it can give it (the output is the same)
        with_lse = dataclasses.replace(request, return_lse=True)
        run = with_lse if _refusal(chosen, with_lse) is None else request
        out, weights, lse = _run_finite_rule(chosen, run)
        record(
            target,
            request.q,
            request.k,
            lse,
            mask=request.mask,
            scale=request.scale,
            bias=request.bias,
            q_offset=request.q_offset,
            softcap=request.softcap,
            sinks=request.sinks,
        )
    if not (request.return_weights or request.return_lse):
        return out
    return out, AttentionAux(
        weights if request.return_weights else None, lse if request.return_lse else None
    )


def _run_finite_rule(
    backend: Backend, r: AttentionRequest
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Run the backend under the module's NaN/∞ rule: as it is when every input is finite, else
    on the finite part of the inputs, with the rows that reach a non-finite value set to NaN. A
    backend with ``finite_rule=False`` refuses non-finite inputs itself and runs once."""
    out, weights, lse = backend.run(r)
    if not backend.finite_rule:
        return out, weights, lse
    if tracing():  # values cannot reach Python here: a non-finite input is an error instead
        check_traced(r.q, r.k, r.v, r.bias)
        return out, weights, lse
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
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> str:
    """Say which backend ``auto`` would pick for this call, and why: ``"name (reasons): doc"``,
    the reasons being why auto passed each earlier backend by. When the verdict on a backend
    depends on the state of this process — flex is taken only for a signature already compiled
    here — a last sentence says so."""
    request = _request(
        q, k, v, mask, None, bias, q_offset, 0.0, return_weights, False, softcap, sinks
    )
    chosen, refused = _choose(request)
    why = "; ".join(f"not {name}: {reason}" for name, reason in refused) or "the first choice"
    notes = []
    for name in [*(name for name, _ in refused), chosen.name]:
        backend = _BACKENDS[name]
        if backend.note is not None and _refusal(backend, request) is None:
            note = backend.note(request)  # only where it could serve: its verdict is auto's
            notes += [] if note is None else [note]
    text = f"{chosen.name} ({why}): {chosen.doc}"
    return text + (f". Depends on this process: {'; '.join(notes)}." if notes else "")
