"""PyTorch's FlexAttention (``torch.nn.attention.flex_attention``) as a dikkat backend.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.

A dikkat mask becomes flex's ``mask_mod`` and a cached block mask (:mod:`dikkat.core.flex_masks`);
a bias becomes a ``score_mod`` adding its entry, after soft-capping the score when ``softcap`` is
set (the order of Gemma 2's attention, docs/attention.md "Soft-capping").

Compiling: flex is fast only compiled, and a compile costs seconds to a minute per signature
(shapes, dtype, mask structure). An explicit ``backend="flex"`` compiles (that is the caller's
choice) except for short calls (``flex_eager_max_cells`` in :mod:`dikkat.core.tuning`), which run
flex eagerly (it then materialises the scores, harmless at that size). ``auto`` never compiles
silently: it takes flex only for a signature this process has compiled (:data:`compiled`), or
where the device's tuning says a compile pays for itself (:func:`auto_verdict`). So auto's
choice depends on what has been compiled already, and ``dikkat.explain`` says so.

State: the block masks (:data:`block_masks`) and the record of compiled signatures
(:data:`compiled`) are objects of this module that ``dikkat.core.clear_caches()`` empties. The
compiled graphs themselves live in torch's dynamo cache, which belongs to the whole process:
dikkat never resets it (``torch._dynamo.reset()`` would drop every compiled graph the user has).
Dynamo has been seen to fail with a ``TypeError`` inside torch (torch 2.13,
``recompilation_reason_for_no_tensor_aliasing_guard``) while explaining a recompile, when one
tensor came as both q and k after graphs for other signatures: flex passes such a tensor as
distinct views, which avoids it. Should dynamo fail so on a call anyway, that call runs on the
tiled backend instead — the same attention, exact up to rounding — with a ``RuntimeWarning``.

What differs from the reference: no weights, no dropout. Rows with every key masked give 0 (and
lse −inf). On CPU torch (2.13) gives flex neither a backward nor, compiled, a log-sum-exp: there
the lse is refused and the gradients are the tiled backend's, which recomputes its own forward (so
a CPU training step pays one extra forward pass). A bias that needs a gradient takes that route on
every device: flex's own gradient for a tensor captured by ``score_mod`` is not checked here. The
tiled backend soft-caps as flex does, so a soft-capped call takes that route alike. A call with no
score cells (B, T or S = 0), which flex itself cannot reduce over, is the tiled backend's: zeros,
and lse −inf.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from dikkat.core import tuning
from dikkat.core.flex_masks import BlockMaskCache, block_masks, build_block_mask, flex_module
from dikkat.core.flex_support import flex_supports, traced_refusal
from dikkat.core.flex_support import needs_grad as _needs_grad
from dikkat.core.mask_keys import describe, is_builtin
from dikkat.core.masks import Mask
from dikkat.core.tiled import tiled_attention
from dikkat.core.tracing import tracing

__all__ = [
    "BlockMaskCache",
    "CompiledFlex",
    "auto_verdict",
    "block_masks",
    "compiled",
    "flex_attention",
    "flex_supports",
    "is_warm",
    "traced_refusal",
]

# Dynamo stops compiling a function after this many signatures (its default is 8, too few for a
# benchmark sweeping n, dtypes and masks) and would then run flex eagerly, without warning.
MAX_COMPILED_SIGNATURES = 64


def _layout(t: Tensor) -> tuple:
    # What a compiled kernel is specialised on: dynamo guards on a captured tensor's layout, not
    # on its values (new document ids of the same shape reuse the kernel).
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _score_mod(bias: Tensor | None, softcap: float | None) -> Callable[..., Tensor] | None:
    """``softcap · tanh(score / softcap)`` when ``softcap`` is set, then ``+ bias[b, h, q, kv]``
    (a bias dimension of size 1 is indexed at 0: broadcast); None when there is neither. flex's
    score is already scaled, so this is the reference's order."""
    if bias is None and softcap is None:
        return None

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is None:
            return score
        idx = (b, h, q_idx, kv_idx)
        idx = tuple(
            i if n > 1 else torch.zeros_like(i) for i, n in zip(idx, bias.shape, strict=True)
        )
        return score + bias[idx]

    return score_mod


# --- compiled and eager kernels -----------------------------------------------------------------


class CompiledFlex:
    """``flex_attention`` under ``torch.compile`` (wrapped on first use), and the signatures this
    process has run it for: what ``auto`` reads to take flex only where no compile is due."""

    def __init__(self) -> None:
        self._fn: Callable | None = None
        self._signatures: set[tuple] = set()

    def __call__(self, signature: tuple, *args: object, **kwargs: object) -> object:
        if self._fn is None:
            self._fn = torch.compile(flex_module().flex_attention, dynamic=False)  # type: ignore[union-attr]
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SIGNATURES):
            result = self._fn(*args, **kwargs)
        self._signatures.add(signature)
        return result

    def __contains__(self, signature: tuple) -> bool:
        return signature in self._signatures

    def __len__(self) -> int:
        return len(self._signatures)

    def clear(self) -> None:
        """Forget the compiled signatures (auto then passes flex by until a call with
        ``backend="flex"`` runs each again). The graphs stay in torch's dynamo cache, which is
        the process's: clearing never resets it."""
        self._signatures.clear()


compiled = CompiledFlex()


def _signature(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bias: Tensor | None, scale: float,
    q_offset: int, grad: bool, softcap: float | None = None,
) -> tuple:  # fmt: skip
    """What a compiled flex kernel is specialised on (a superset of dynamo's guards)."""
    return (
        *(_layout(t) for t in (q, k, v)),
        describe(mask, _layout),
        describe(bias, _layout),
        scale,
        q_offset,
        grad,
        softcap,
    )


def _cells(q: Tensor, k: Tensor) -> int:
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]


def is_warm(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None = None, *, scale: float,
            bias: Tensor | None = None, q_offset: int = 0,
            softcap: float | None = None) -> bool:  # fmt: skip
    """Whether flex has already been compiled in this process for a call like this one."""
    if mask is not None and not is_builtin(mask):
        return False  # a mask of the caller's own type: dynamo's guards on it are unknown here
    grad = _needs_grad(q, k, v) and q.device.type != "cpu"
    return _signature(q, k, v, mask, bias, scale, q_offset, grad, softcap) in compiled


def _dynamo_failed(error: TypeError) -> bool:
    """Whether a TypeError is dynamo's own failure (an operation on None inside torch), not the
    caller's: their inputs are checked before flex runs."""
    return "NoneType" in str(error)


def _kwargs(
    block_mask: object, bias: Tensor | None, scale: float, enable_gqa: bool, return_lse: bool,
    softcap: float | None,
) -> dict:  # fmt: skip
    kwargs: dict = {
        "score_mod": _score_mod(bias, softcap),
        "block_mask": block_mask,
        "scale": scale,
        "enable_gqa": enable_gqa,
    }
    if return_lse:
        api = flex_module()
        if hasattr(api, "AuxRequest"):  # torch ≥ 2.9; return_lse is deprecated there
            kwargs["return_aux"] = api.AuxRequest(lse=True)  # type: ignore[union-attr]
        else:  # pragma: no cover
            kwargs["return_lse"] = True
    return kwargs


def _split(result: object, return_lse: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    if not return_lse:
        return result, None  # type: ignore[return-value]
    out, aux = result  # type: ignore[misc]
    lse = aux if isinstance(aux, Tensor) else aux.lse
    return out, lse.to(torch.promote_types(dtype, torch.float32))  # fp32 (fp64 for fp64)


def _traced_call(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bias: Tensor | None, scale: float,
    q_offset: int, return_lse: bool, softcap: float | None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Inside ``torch.compile`` or ``torch.export``: torch's ``flex_attention`` itself, which
    dynamo records as a higher-order op and the outer compiler lowers, with the block mask
    built in the trace. No inner ``torch.compile``, no cache, no record of signatures: the outer
    compile owns all of that."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    block_mask = None if mask is None else build_block_mask(mask, B, H, T, S, q_offset, q.device)
    kwargs = _kwargs(block_mask, bias, scale, k.shape[1] != H, return_lse, softcap)
    result = flex_module().flex_attention(q, k, v, **kwargs)  # type: ignore[union-attr]
    return _split(result, return_lse, q.dtype)


def _call(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bias: Tensor | None, scale: float,
    q_offset: int, return_lse: bool, softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    if tracing():
        return _traced_call(q, k, v, mask, bias, scale, q_offset, return_lse, softcap)
    B, H, T, _ = q.shape
    S = k.shape[2]
    # dynamo guards that the tensors it was compiled for are distinct objects: one tensor passed
    # as q and k fails that guard, and explaining that recompile can crash inside torch (the
    # TypeError below). Distinct views of it (no copy) pass the guard.
    k = k.view_as(k) if k is q else k
    v = v.view_as(v) if v is q or v is k else v
    block_mask = None if mask is None else block_masks.get(mask, B, H, T, S, q_offset, q.device)
    kwargs = _kwargs(block_mask, bias, scale, k.shape[1] != H, return_lse, softcap)
    api = flex_module()
    try:
        if _cells(q, k) <= tuning.for_device(q.device).flex_eager_max_cells:
            with warnings.catch_warnings():  # flex warns that eager is slow: here it is meant
                warnings.simplefilter("ignore", UserWarning)
                result = api.flex_attention(q, k, v, **kwargs)  # type: ignore[union-attr]
        else:
            grad = _needs_grad(q, k, v)
            signature = _signature(q, k, v, mask, bias, scale, q_offset, grad, softcap)
            result = compiled(signature, q, k, v, **kwargs)
    except TypeError as e:
        if not _dynamo_failed(e):
            raise
        warnings.warn(
            f"flex: torch's dynamo failed ({type(e).__name__}: {e}); this call ran on the "
            "tiled backend instead (the same attention). dikkat does not reset dynamo, "
            "which would drop every compiled graph in the process.",
            RuntimeWarning,
            stacklevel=2,
        )
        out, lse = tiled_attention(
            q, k, v, mask, scale=scale, softcap=softcap, bias=bias, q_offset=q_offset
        )
        return out, (lse.to(torch.promote_types(q.dtype, torch.float32)) if return_lse else None)
    return _split(result, return_lse, q.dtype)


class _FlexTiledBackward(torch.autograd.Function):
    """Flex forward, tiled backward: for CPU, where torch's flex has no backward, and for a bias
    that needs a gradient."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Mask | None,
        scale: float, q_offset: int, return_lse: bool, softcap: float | None,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        ctx.save_for_backward(q, k, v, bias)
        ctx.args = (mask, scale, q_offset, softcap)
        # flex refuses CPU inputs that require grad, even with grad mode off
        q, k, v = q.detach(), k.detach(), v.detach()
        bias = None if bias is None else bias.detach()
        out, lse = _call(q, k, v, mask, bias, scale, q_offset, return_lse, softcap)
        if lse is None:
            return out
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor | None = None) -> tuple[Tensor | None, ...]:
        q, k, v, bias = ctx.saved_tensors
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        if bias is not None and ctx.needs_input_grad[3]:
            bias = bias.detach().requires_grad_()
            inputs.append(bias)
        mask, scale, q_offset, softcap = ctx.args
        with torch.enable_grad():
            out, _ = tiled_attention(
                *inputs[:3], mask, scale=scale, softcap=softcap, bias=bias, q_offset=q_offset
            )
            grads = torch.autograd.grad(out, inputs, dout)
        dbias = grads[3] if len(grads) == 4 else None
        return grads[0], grads[1], grads[2], dbias, None, None, None, None, None


def flex_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None = None,
    *,
    scale: float,
    bias: Tensor | None = None,
    q_offset: int = 0,
    return_lse: bool = False,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention through FlexAttention: ``(out (B, H, T, Dv), lse (B, H, T) or None)``, shapes
    as in the reference; see :func:`flex_supports` for what it refuses."""
    reason = flex_supports(q, return_lse=return_lse, k=k, v=v, bias=bias)
    if reason is not None:
        raise ValueError(f"flex_attention cannot serve this call: {reason}")
    if bias is not None:  # viewed as (B|1, H|1, T|1, S|1)
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    if q.shape[0] * q.shape[2] * k.shape[2] == 0:  # no score cells: nothing for flex to reduce
        out, lse = tiled_attention(
            q, k, v, mask, scale=scale, softcap=softcap, bias=bias, q_offset=q_offset
        )
        return out, lse if return_lse else None
    tiled_backward = bias is not None and _needs_grad(bias)
    if q.device.type == "cpu" and any(t.requires_grad for t in (q, k, v)):
        if not _needs_grad(q, k, v):  # flex refuses inputs that require grad on CPU
            q, k, v = q.detach(), k.detach(), v.detach()
        else:
            tiled_backward = True
    if tiled_backward:
        result = _FlexTiledBackward.apply(q, k, v, bias, mask, scale, q_offset, return_lse, softcap)
        return result if return_lse else (result, None)
    bias = None if bias is None else bias.detach()
    return _call(q, k, v, mask, bias, scale, q_offset, return_lse, softcap)


# --- auto's verdict (what the backend accepts: dikkat.core.flex_support) -----------------------


def auto_verdict(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, *, scale: float, bias: Tensor | None,
    q_offset: int, softcap: float | None = None,
) -> tuple[str | None, str | None]:  # fmt: skip
    """``auto``'s verdict on flex for a call it could serve: (why auto passes flex by, or None
    when it takes it; a note for ``explain`` when that verdict depends on what this process has
    compiled, else None)."""
    if softcap is None and (mask is None or mask.is_causal):
        return "SDPA's fused kernels serve no mask and causal", None
    tune = tuning.for_device(q.device)
    if _cells(q, k) <= tune.flex_eager_max_cells:
        return "the call is too short for flex to pay (it would run eagerly)", None
    if bias is not None:
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    long = tune.flex_auto_compile_min_cells
    if long is not None and q.shape[2] * k.shape[2] >= long:
        return None, None  # long enough that a compile pays for itself (dikkat.core.tuning)
    if is_warm(q, k, v, mask, scale=scale, bias=bias, q_offset=q_offset, softcap=softcap):
        note = "flex is taken because this process has compiled it for this signature"
        return None, note + " (before that compile, auto passed it by)"
    note = "auto takes flex once a call with backend='flex' has compiled it for this signature"
    return "flex is not yet compiled for this signature (backend='flex' compiles it)", note
