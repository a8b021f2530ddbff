"""PyTorch's FlexAttention (``torch.nn.attention.flex_attention``) as a dikkat backend.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims.

A dikkat mask becomes flex's ``mask_mod`` by one shift: flex numbers the queries 0 … T − 1 while
dikkat's predicates take absolute positions, so ``mask_mod(b, h, i, j) = predicate(b, h,
i + q_offset, j)``. From it ``create_block_mask`` finds the 128 × 128 blocks with no allowed pair
(skipped) and those with every pair allowed (run unmasked). That costs a pass over the T × S grid,
so block masks are cached (:data:`block_masks`). A bias becomes a ``score_mod`` adding its entry.

Compiling: flex is fast only compiled, and a compile costs seconds to a minute per signature
(shapes, dtype, mask structure). An explicit ``backend="flex"`` compiles (that is the caller's
choice) except for calls of at most :data:`EAGER_MAX_CELLS` score cells, which run flex eagerly
(it then materialises the scores, harmless at that size). ``auto`` never compiles silently: it
takes flex only for a signature already compiled here, or on CUDA for a call so long that the
compile pays for itself (:func:`auto_avoid`).

What differs from the reference: no weights, no dropout. Rows with every key masked give 0 (and
lse −inf). On CPU torch (2.13) gives flex neither a backward nor, compiled, a log-sum-exp: there
the lse is refused and the gradients are the tiled backend's, which recomputes its own forward (so
a CPU training step pays one extra forward pass). A bias that needs a gradient takes that route on
every device: flex's own gradient for a tensor captured by ``score_mod`` is not checked here. A
call with no score cells (B, T or S = 0), which flex itself cannot reduce over, is the tiled
backend's: zeros, and lse −inf.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from dikkat.core.masks import Mask, is_builtin
from dikkat.core.masks import describe as _describe
from dikkat.core.masks import tensor_identity as _contents
from dikkat.core.tiled import tiled_attention

try:  # torch ≥ 2.5
    from torch.nn.attention import flex_attention as _flex
except ImportError:  # pragma: no cover — older torch: the backend says so in ``supports``
    _flex = None

__all__ = [
    "AUTO_COMPILE_MIN_CELLS",
    "EAGER_MAX_CELLS",
    "BlockMaskCache",
    "block_masks",
    "flex_attention",
    "flex_supports",
    "is_warm",
]

# Calls with at most this many score cells (B·H·T·S) run flex eagerly, never compiled: a compile
# (tens of seconds on CPU) would cost more than any such call, and eager scores take ≤ 4 MiB.
EAGER_MAX_CELLS = 1 << 20
# On CUDA, auto may compile flex for a call with at least this many score cells per batch and
# head (T·S): a few seconds of compiling against a call that masks most of a 4096² grid.
AUTO_COMPILE_MIN_CELLS = 1 << 24
# Dynamo stops compiling a function after this many signatures (its default is 8, too few for a
# benchmark sweeping n, dtypes and masks) and would then run flex eagerly, without warning.
MAX_COMPILED_SIGNATURES = 64
_DEVICES = ("cuda", "cpu", "xpu", "hpu", "mps")


# --- the mask as flex sees it -------------------------------------------------------------------


def _layout(t: Tensor) -> tuple:
    # What a compiled kernel is specialised on: dynamo guards on a captured tensor's layout, not
    # on its values (new document ids of the same shape reuse the kernel).
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _mask_mod(mask: Mask, q_offset: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask.predicate(b, h, q_idx + q_offset, kv_idx)

    return mask_mod


def _score_mod(bias: Tensor) -> Callable[..., Tensor]:
    """Adds ``bias[b, h, q, kv]``; a bias dimension of size 1 is indexed at 0 (broadcast)."""

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        idx = (b, h, q_idx, kv_idx)
        idx = tuple(
            i if n > 1 else torch.zeros_like(i) for i, n in zip(idx, bias.shape, strict=True)
        )
        return score + bias[idx]

    return score_mod


class BlockMaskCache:
    """Least-recently-used flex ``BlockMask``s, keyed on the mask (built-in masks by their
    parameters and tensors, others by identity), the grid (B, H, T, S), ``q_offset`` and device.

    A cached block mask is reused only for a mask that allows exactly the same pairs: equal
    parameters, the very same tensors, unchanged since (their in-place version is in the key).
    """

    def __init__(self, maxsize: int = 16) -> None:
        self.maxsize = maxsize
        self.builds = 0  # block masks built (cache misses)
        self.hits = 0
        self._entries: OrderedDict[tuple, tuple[Mask, object]] = OrderedDict()

    def get(self, mask: Mask, B: int, H: int, T: int, S: int, q_offset: int, device) -> object:
        key = (_describe(mask, _contents), B, H, T, S, q_offset, torch.device(device))
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key][1]
        try:
            # Grid dimensions the predicate does not index stay 1 in the block mask (flex
            # broadcasts them).
            probe = mask.evaluate(
                torch.arange(B, device=device),
                torch.arange(H, device=device),
                torch.arange(q_offset, q_offset + 1, device=device),
                torch.arange(1, device=device),
            )
            Bm, Hm = (None if n == 1 else n for n in probe.shape[:2])
            block_mask = _flex.create_block_mask(_mask_mod(mask, q_offset), Bm, Hm, T, S, device)
        except Exception as e:  # a predicate of the caller's own that torch.vmap cannot run
            raise ValueError(
                f"flex cannot build a block mask from {type(mask).__name__}: its predicate must "
                f"run under torch.vmap on 0-d index tensors ({type(e).__name__}: {e})"
            ) from e
        self.builds += 1
        self._entries[key] = (mask, block_mask)  # the mask is held: see ``_contents``
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return block_mask

    def clear(self) -> None:
        self._entries.clear()
        self.builds = self.hits = 0


block_masks = BlockMaskCache()


# --- compiled and eager kernels -----------------------------------------------------------------

_warm: set[tuple] = set()  # signatures this process has compiled flex for


@functools.cache
def _compiled() -> Callable:
    return torch.compile(_flex.flex_attention, dynamic=False)


def _signature(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bias: Tensor | None, scale: float,
    q_offset: int, grad: bool,
) -> tuple:  # fmt: skip
    """What a compiled flex kernel is specialised on (a superset of dynamo's guards)."""
    return (
        *(_layout(t) for t in (q, k, v)),
        _describe(mask, _layout),
        _describe(bias, _layout),
        scale,
        q_offset,
        grad,
    )


def _cells(q: Tensor, k: Tensor) -> int:
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]


def is_warm(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None = None, *, scale: float,
            bias: Tensor | None = None, q_offset: int = 0) -> bool:  # fmt: skip
    """Whether flex has already been compiled here for a call like this one."""
    if mask is not None and not is_builtin(mask):
        return False  # a mask of the caller's own type: dynamo's guards on it are unknown here
    grad = _needs_grad(q, k, v) and q.device.type != "cpu"
    return _signature(q, k, v, mask, bias, scale, q_offset, grad) in _warm


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _retrying(fn: Callable, *args: object, **kwargs: object) -> object:
    """``fn(*args, **kwargs)``, once more after resetting dynamo if dynamo itself fails while
    explaining a recompile (a TypeError inside torch seen after many mask signatures in one
    process); the reset drops every compiled kernel, so none counts as warm any more."""
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        if "NoneType" not in str(e):
            raise
        torch._dynamo.reset()
        _warm.clear()
        return fn(*args, **kwargs)


def _call(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bias: Tensor | None, scale: float,
    q_offset: int, return_lse: bool,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    B, H, T, _ = q.shape
    S = k.shape[2]
    block_mask = None if mask is None else block_masks.get(mask, B, H, T, S, q_offset, q.device)
    kwargs: dict = {
        "score_mod": None if bias is None else _score_mod(bias),
        "block_mask": block_mask,
        "scale": scale,
        "enable_gqa": k.shape[1] != H,
    }
    if return_lse:
        if hasattr(_flex, "AuxRequest"):  # torch ≥ 2.9; return_lse is deprecated there
            kwargs["return_aux"] = _flex.AuxRequest(lse=True)
        else:  # pragma: no cover
            kwargs["return_lse"] = True
    if _cells(q, k) <= EAGER_MAX_CELLS:
        with warnings.catch_warnings():  # flex warns that eager is slow: here it is deliberate
            warnings.simplefilter("ignore", UserWarning)
            result = _retrying(_flex.flex_attention, q, k, v, **kwargs)
    else:
        signature = _signature(q, k, v, mask, bias, scale, q_offset, _needs_grad(q, k, v))
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SIGNATURES):
            result = _retrying(_compiled(), q, k, v, **kwargs)
        _warm.add(signature)
    if not return_lse:
        return result, None
    out, aux = result
    lse = aux if isinstance(aux, Tensor) else aux.lse
    return out, lse.to(torch.promote_types(q.dtype, torch.float32))  # fp32 (fp64 for fp64)


class _FlexTiledBackward(torch.autograd.Function):
    """Flex forward, tiled backward: for CPU, where torch's flex has no backward, and for a bias
    that needs a gradient."""

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, scale, q_offset, return_lse):
        ctx.save_for_backward(q, k, v, bias)
        ctx.args = (mask, scale, q_offset)
        # flex refuses CPU inputs that require grad, even with grad mode off
        q, k, v = q.detach(), k.detach(), v.detach()
        bias = None if bias is None else bias.detach()
        out, lse = _call(q, k, v, mask, bias, scale, q_offset, return_lse)
        if lse is None:
            return out
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse=None):
        q, k, v, bias = ctx.saved_tensors
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        if bias is not None and ctx.needs_input_grad[3]:
            bias = bias.detach().requires_grad_()
            inputs.append(bias)
        mask, scale, q_offset = ctx.args
        with torch.enable_grad():
            out, _ = tiled_attention(*inputs[:3], mask, scale=scale, bias=bias, q_offset=q_offset)
            grads = torch.autograd.grad(out, inputs, dout)
        dbias = grads[3] if len(grads) == 4 else None
        return grads[0], grads[1], grads[2], dbias, None, None, None, None


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
) -> tuple[Tensor, Tensor | None]:
    """Attention through FlexAttention: ``(out (B, H, T, Dv), lse (B, H, T) or None)``, shapes
    as in the reference; see :func:`flex_supports` for what it refuses."""
    reason = flex_supports(q, return_lse=return_lse)
    if reason is not None:
        raise ValueError(f"flex_attention cannot serve this call: {reason}")
    if bias is not None:  # viewed as (B|1, H|1, T|1, S|1)
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    if q.shape[0] * q.shape[2] * k.shape[2] == 0:  # no score cells: nothing for flex to reduce
        out, lse = tiled_attention(q, k, v, mask, scale=scale, bias=bias, q_offset=q_offset)
        return out, lse if return_lse else None
    tiled_backward = bias is not None and _needs_grad(bias)
    if q.device.type == "cpu" and any(t.requires_grad for t in (q, k, v)):
        if not _needs_grad(q, k, v):  # flex refuses inputs that require grad on CPU
            q, k, v = q.detach(), k.detach(), v.detach()
        else:
            tiled_backward = True
    if tiled_backward:
        result = _FlexTiledBackward.apply(q, k, v, bias, mask, scale, q_offset, return_lse)
        return result if return_lse else (result, None)
    bias = None if bias is None else bias.detach()
    return _call(q, k, v, mask, bias, scale, q_offset, return_lse)


# --- what the backend accepts -------------------------------------------------------------------


def flex_supports(
    q: Tensor,
    *,
    dropout: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
) -> str | None:
    """None when flex can serve a call like this, else the reason it cannot."""
    if _flex is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs ≥ 2.5)"
    if return_weights:
        return "it never holds the full weights (use return_lse and dikkat.attention_weights)"
    if dropout > 0:
        return "FlexAttention has no dropout"
    if q.device.type not in _DEVICES:
        return f"FlexAttention runs on {', '.join(_DEVICES)}, not {q.device.type}"
    if return_lse and q.device.type == "cpu":
        return f"compiled FlexAttention on CPU returns no log-sum-exp (torch {torch.__version__})"
    return None


def auto_avoid(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, *, scale: float, bias: Tensor | None,
    q_offset: int,
) -> str | None:  # fmt: skip
    """Why ``auto`` passes flex by for a call it could serve (None: auto takes it)."""
    if mask is None or mask.is_causal:
        return "SDPA's fused kernels serve no mask and causal"
    if _cells(q, k) <= EAGER_MAX_CELLS:
        return "the call is too short for flex to pay (it would run eagerly)"
    if bias is not None:
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    if is_warm(q, k, v, mask, scale=scale, bias=bias, q_offset=q_offset):
        return None
    if q.device.type == "cuda" and q.shape[2] * k.shape[2] >= AUTO_COMPILE_MIN_CELLS:
        return None  # long enough on a GPU that a compile of a few seconds pays for itself
    return "flex is not yet compiled for this signature (backend='flex' compiles it)"
