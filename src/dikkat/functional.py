"""``scaled_dot_product_attention`` with torch's signature, on dikkat's backends: a drop-in.

Swap one import and a model gives the same logits::

    from dikkat.functional import scaled_dot_product_attention  # was torch.nn.functional's

or route every caller of torch's function at once, torch's own modules included::

    import torch.nn.functional as F
    F.scaled_dot_product_attention = dikkat.functional.scaled_dot_product_attention

The contract is torch's (the ``torch.nn.functional.scaled_dot_product_attention`` docs page):
any number of leading batch dims, ``(…, L, E)`` queries against ``(…, S, E)`` keys and
``(…, S, Ev)`` values broadcast against each other; a bool ``attn_mask`` where True takes part,
or a float one added to the scores; ``is_causal`` the upper-left causal mask (not together
with ``attn_mask``, as torch's docs say); ``torch.nn.attention.bias.CausalBias`` for
either corner; dropout on the weights with torch's 1/(1 − p) scaling; any float ``scale``;
``enable_gqa`` for fewer key/value heads. Bad arguments raise what torch raises for them: each
call's shapes, dtypes and flags go through torch's own checks first, on the meta device (no
data, no kernel). dikkat adds a ``backend`` argument (docs/attention.md, "Drop-in for torch").

Where the answer can differ: a row whose every key is masked gives 0, as torch ≥ 2.5 does; a
non-finite input follows dikkat's NaN rule (docs/attention.md), which torch does not promise;
dropout draws its random numbers in another order than torch's kernels do unless the ``sdpa``
backend serves the call (``auto`` picks it whenever it can).
"""

import math
from typing import Optional

import torch
from torch import Tensor

from dikkat.core import masks
from dikkat.core.attention import attention
from dikkat.core.sdpa import TORCH_SDPA
from dikkat.core.tracing import tracing

__all__ = ["SDPAArgumentError", "scaled_dot_product_attention"]


class SDPAArgumentError(ValueError, RuntimeError):
    """A bad argument where torch raises ``RuntimeError``: catchable as that, and as the
    ``ValueError`` every dikkat function raises for one."""


# call signatures torch's checks have passed (a decoding loop repeats a few): checked once each
_PASSED: dict[tuple, None] = {}
_PASSED_MAX = 1024


def _meta(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _check_like_torch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> None:
    """Run torch's own argument checks on meta copies of the inputs: the same exception type
    (a ``RuntimeError`` becomes :class:`SDPAArgumentError`, which is one) for the same mistake."""
    tensors = {"query": query, "key": key, "value": value, "attn_mask": attn_mask}
    for name, t in tensors.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(
                f"scaled_dot_product_attention(): argument '{name}' must be Tensor, "
                f"not {type(t).__name__}"
            )
    devices = {t.device.type for t in tensors.values() if t is not None}
    if len(devices) > 1:
        found = ", ".join(f"{n}: {t.device}" for n, t in tensors.items() if t is not None)
        raise SDPAArgumentError(f"query, key, value and attn_mask must share a device, got {found}")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise SDPAArgumentError(f"dropout_p must be in [0, 1], got {dropout_p}")
    signature = (
        *(None if t is None else (t.shape, t.dtype, t.device) for t in tensors.values()),
        dropout_p > 0, is_causal, scale is None, enable_gqa,
    )  # fmt: skip
    if signature in _PASSED:  # torch's checks read only these (not strides, not values)
        return
    try:
        TORCH_SDPA(
            _meta(query),
            _meta(key),
            _meta(value),
            attn_mask=None if attn_mask is None else _meta(attn_mask),
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    except RuntimeError as e:
        raise SDPAArgumentError(f"scaled_dot_product_attention: {e}") from None
    if len(_PASSED) >= _PASSED_MAX:
        _PASSED.pop(next(iter(_PASSED)))
    _PASSED[signature] = None


def _causal_bias(attn_mask: object) -> tuple[int, int, int] | None:
    """(seq_len_q, seq_len_kv, q_offset) of a ``CausalBias``; None for anything else."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if not isinstance(attn_mask, CausalBias):
        return None
    L, S = attn_mask.seq_len_q, attn_mask.seq_len_kv
    # upper left: query i sees keys 0 … i; lower right: the last query sees the last key
    return L, S, 0 if attn_mask.variant == CausalVariant.UPPER_LEFT else S - L


def _lead(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> tuple[int, ...]:
    """The broadcast leading dims of the output (everything before L and E)."""
    if not enable_gqa:
        return tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2]))
    batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    return (*batch, query.shape[-3])


def _heads(t: Tensor) -> int:
    return t.shape[-3] if t.dim() >= 3 else 1


def _as_4d(t: Tensor, lead: tuple[int, ...], heads: int) -> Tensor:
    """t (…, N, X) broadcast to ``lead[:-1] + (heads, N, X)`` and seen as (B, heads, N, X)."""
    batch = lead[:-1] if lead else ()
    t = t.expand(*batch, heads, *t.shape[-2:])
    return t.reshape(-1, heads, *t.shape[-2:]) if len(batch) != 1 else t


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,  # noqa: UP045 — TorchScript reads these annotations
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,  # noqa: UP045
    enable_gqa: bool = False,
    backend: str = "auto",
) -> Tensor:
    """torch's ``scaled_dot_product_attention``, computed by ``dikkat.attention``.

    Args:
        query: (N, …, Hq, L, E); key: (N, …, H, S, E); value: (N, …, H, S, Ev). The leading
            dims broadcast; with ``enable_gqa`` H divides Hq instead.
        attn_mask: bool (True takes part) or float (added to the scores), broadcastable to
            (N, …, L, S); or a ``torch.nn.attention.bias.CausalBias``.
        dropout_p: probability of dropping a weight; applied whenever it is above 0, as torch
            does (pass 0 at evaluation).
        is_causal: the upper-left causal mask; not with ``attn_mask``.
        scale: multiplies the scores; default 1/√E; any finite float.
        enable_gqa: key/value heads H may divide the query heads Hq (grouped-query attention).
        backend: beyond torch's signature: the dikkat backend, ``"auto"`` or one of
            ``dikkat.available_backends()``.

    Returns:
        (N, …, Hq, L, Ev).

    Under ``torch.jit.script`` this function compiles to a call of :func:`_sdpa`, which runs
    in Python (``torch.jit.ignore``): a scripted module that calls it runs, and cannot be saved.
    """
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend)


@torch.jit.ignore
def _sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],  # noqa: UP045
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],  # noqa: UP045
    enable_gqa: bool,
    backend: str,
) -> Tensor:
    if any(isinstance(t, Tensor) and t.is_nested for t in (query, key, value)):
        if any(isinstance(t, Tensor) and t.is_nested and t.layout == torch.strided
               for t in (query, key, value)):  # fmt: skip
            return _strided_nested(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend
            )
        return _jagged(query, key, value, attn_mask, dropout_p, is_causal, scale, backend)
    causal_bias = _causal_bias(attn_mask)
    if causal_bias is not None:
        if is_causal:
            raise ValueError("CausalBias should not be used with causal=True")  # torch's words
        L, S, q_offset = causal_bias
        if (query.shape[-2], key.shape[-2]) != (L, S):
            raise ValueError(
                f"attn_mask is a CausalBias for {L} queries and {S} keys, but query "
                f"{tuple(query.shape)} and key {tuple(key.shape)} have {query.shape[-2]} and "
                f"{key.shape[-2]}"
            )
        attn_mask, is_causal = None, False
    else:
        q_offset = 0
    if attn_mask is not None and is_causal:  # torch's docs, and torch's words: an error
        raise SDPAArgumentError(
            "scaled_dot_product_attention: Explicit attn_mask should not be set when "
            "is_causal=True (pass one of them: AND the causal mask into attn_mask, or pass a "
            "torch.nn.attention.bias.CausalBias)"
        )
    if not tracing():  # torch's checks, once, outside any compiled or transformed region
        _check_like_torch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if scale is not None and not math.isfinite(scale):
        raise SDPAArgumentError(f"scale must be a finite float, got {scale}")

    L, Ev = query.shape[-2], value.shape[-1]
    lead = _lead(query, key, value, enable_gqa)
    Hq = lead[-1] if lead else 1
    # key/value heads: without enable_gqa each is 1 or Hq (broadcast), with it H dividing Hq
    G = max(_heads(key), _heads(value))
    if (
        all(t.dim() == 4 for t in (query, key, value))
        and query.shape[:2] == lead
        and key.shape[:2] == value.shape[:2]
    ):
        q, k, v = query, key, value  # dikkat takes (B|1) keys and G | Hq key heads as they are
    else:
        q, k, v = _as_4d(query, lead, Hq), _as_4d(key, lead, G), _as_4d(value, lead, G)
    bias = mask = None
    if attn_mask is not None:
        if attn_mask.dim() > 2 and len(lead) != 2:
            attn_mask = _as_4d(attn_mask, lead, Hq)
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        else:
            bias = attn_mask
    if is_causal or causal_bias is not None:
        mask = masks.causal()
    out = attention(
        q,
        k,
        v,
        mask,
        scale=scale,
        bias=bias,
        q_offset=q_offset,
        dropout=float(dropout_p),
        backend=backend,
    )
    return out.reshape(*lead, L, Ev) if out.shape[:-2] != lead else out


def _strided_nested(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
) -> Tensor:
    """Strided nested tensors (torch's older nested layout) go to torch's own kernel, which is
    the only one that reads them: the answer, and the error for what it refuses (a
    ``RuntimeError`` for a causal or non-contiguous call), are torch's."""
    if backend not in ("auto", "sdpa"):
        raise ValueError(
            f"backend={backend!r} cannot read strided nested tensors; only torch's own kernel "
            "does (backend='auto' or 'sdpa'), or pass jagged ones (layout=torch.jagged)"
        )
    return TORCH_SDPA(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def _jagged(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    backend: str,
) -> Tensor:
    """Jagged nested q (B, H, j, E), k (B, H, j', E), v (B, H, j', Ev) (``layout=torch.jagged``,
    the ragged dim transposed behind the heads, as torch's nested-tensor tutorial lays them out):
    each sequence attends to its own keys only, one dense call per sequence, so no padding is
    computed; ``is_causal`` is upper-left within each sequence. The output shares q's offsets,
    so it adds to tensors of q's ragged length."""
    where = "query, key and value"
    if not all(isinstance(t, Tensor) and t.is_nested for t in (query, key, value)):
        raise ValueError(f"{where} must all be nested tensors or none of them")
    if attn_mask is not None:
        raise ValueError(
            "attn_mask cannot go with jagged nested query, key and value (torch refuses it "
            "too); pass dense tensors with the mask, or is_causal=True"
        )
    if tracing():
        raise ValueError(
            "jagged nested query, key and value run one dense call per sequence, which cannot "
            "be traced (torch.compile, export, vmap): pass dense tensors with "
            "dikkat.masks.document, or call it eagerly"
        )
    if query.dim() != 4 or query._ragged_idx != 2:  # type: ignore[attr-defined]
        raise ValueError(
            f"jagged nested query must be (B, H, j, E) with the ragged dim third (nt.unflatten"
            f"(-1, [H, E]).transpose(1, 2)), got shape {tuple(query.shape)}"
        )
    outs = [
        _sdpa(q, k, v, None, dropout_p, is_causal, scale, False, backend).transpose(
            0, 1
        )  # (L_i, H, Ev)
        for q, k, v in zip(query.unbind(), key.unbind(), value.unbind(), strict=True)
    ]
    values = torch.cat(outs) if outs else query.values().new_zeros(0, *query.shape[1:2], 0)
    out = torch.nested.nested_tensor_from_jagged(values, offsets=query.offsets())
    return out.transpose(1, 2)
