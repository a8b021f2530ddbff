"""dikkat's attention inside Hugging Face models: the function ``AttentionInterface`` calls.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (G divides H), ``T`` query
length, ``S`` key length, ``D`` head dim.

transformers' attention layers call ``attention_interface(module, query, key, value,
attention_mask, dropout=..., scaling=..., **kwargs)`` with q (B, H, T, D), k and v (B, G, S, D)
— grouped-query heads not repeated — and take back ``(out (B, T, H, D), weights | None)``
(https://huggingface.co/docs/transformers/attention_interface). The mask is what the mask
function registered under the same name returned: dikkat's :class:`~dikkat.hf.masks.HFMask`, or
a 4-D tensor the caller built (transformers passes those through unchanged). T5's relative
position bias comes as ``position_bias=`` beside the mask and is dikkat's additive ``bias``;
gpt-oss's attention sinks come as ``s_aux=`` and are dikkat's ``sinks``. Every other keyword is
looked up in :data:`~dikkat.hf.keywords.KEYWORDS`: honoured, accepted with the reason, or refused
by name — never ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.core.attention import attention, check_backend_name, explain
from dikkat.core.masks import Mask
from dikkat.core.weights import attention_weights
from dikkat.hf.keywords import check_keywords, hf_sinks, with_indices
from dikkat.hf.masks import HFMask, hf_mask

__all__ = ["MIN_TRANSFORMERS", "LayerCall", "attention_function", "recording", "register"]

# The oldest transformers dikkat.hf runs on: the oldest release whose tests/hf pass (.ci/hf_floor
# installs exactly it and runs them). pyproject.toml's extras and docs/hf.md say the same
# (tests/hf/test_hf_version.py checks that they do).
MIN_TRANSFORMERS = "5.24.0"

# transformers gives these words a meaning in an attn_implementation name: "sdpa" anywhere runs
# torch's SDPA checks and fallbacks (modeling_utils.get_correct_attn_implementation), "flash" the
# flash-attention paths (utils.generic.is_flash_attention_requested), "flex" and "paged" theirs,
# and "/" is read as a kernel repository on the Hub
_RESERVED = ("sdpa", "flash", "flex", "paged", "/", "|")


@dataclass(frozen=True)
class LayerCall:
    """One attention call of a Hugging Face model through dikkat, as :func:`recording` keeps it."""

    layer: str  # the attention module's class and layer index, "LlamaAttention[0]"
    backend: str  # the dikkat backend that ran it
    why: str  # dikkat.explain's reasons (for "auto"), or that the backend was fixed
    shape: tuple[int, int, int, int]  # (B, H, T, S): a cross-attention call has S ≠ T


_calls: ContextVar[list[LayerCall] | None] = ContextVar("dikkat_hf_calls", default=None)
# recording blocks open in this process, any thread: while there are none, an attention call
# does not read the ContextVar, which torch.compile cannot trace (a plain int it can guard on)
_open = 0


@contextmanager
def recording() -> Iterator[list[LayerCall]]:
    """Within the block, every attention call a model makes through dikkat is appended to the
    list it yields — which backend ran it and why (``dikkat.explain``'s reasons, given for the
    call without dropout, as at evaluation)::

        with dikkat.hf.recording() as calls:
            model(ids)
        for c in calls:
            print(c.layer, c.backend, c.why)
    """
    global _open
    calls: list[LayerCall] = []
    token = _calls.set(calls)
    _open += 1
    try:
        yield calls
    finally:
        _open -= 1
        _calls.reset(token)


def _layer(module: nn.Module) -> str:
    """How messages name an attention layer: its class and layer index, "LlamaAttention[0]"."""
    return f"{type(module).__name__}[{getattr(module, 'layer_idx', '?')}]"


def _record(module: nn.Module, backend: str, *args: Any, **kwargs: Any) -> None:
    if not _open:
        return
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "dikkat.hf.recording cannot record inside torch.compile: run the recorded forward "
            "eagerly"
        )
    calls = _calls.get()
    if calls is None:
        return
    layer = _layer(module)
    q, k = args[0], args[1]
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if backend == "auto":
        why = explain(*args, **kwargs)  # "name (reasons): doc"
        calls.append(LayerCall(layer, why.split(" ", 1)[0], why, shape))
    else:
        fixed = f"{backend}: registered with backend={backend!r}"
        calls.append(LayerCall(layer, backend, fixed, shape))


def register(name: str = "dikkat", *, backend: str = "auto") -> str:
    """Register dikkat's attention and mask functions with transformers under ``name``.

    Afterwards ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` runs every attention layer of the model through
    ``dikkat.attention(..., backend=backend)``, with the masks transformers builds turned into
    dikkat masks (:mod:`dikkat.hf.masks`). Registering the same name again replaces it (with
    the same functions, for the same backend). Returns ``name``.
    """
    check_name(name)
    check_backend_name("backend", backend, exact_only=True)
    install(name, attention_function(backend), hf_mask, "register")
    return name


def check_name(name: object) -> str:
    """``name`` as an ``attn_implementation`` dikkat may register: a non-empty str without the
    words transformers reads a meaning into (:data:`_RESERVED`), and not ``"eager"``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    taken = [word for word in _RESERVED if word in name.lower()]
    if taken or name == "eager":
        raise ValueError(
            f"name {name!r} cannot be registered: transformers gives "
            f"{taken[0] if taken else 'eager'!r} in an attn_implementation name a meaning of its "
            "own (e.g. any name containing 'sdpa' is run as torch's SDPA); choose another name"
        )
    return name


def install(name: str, attention_fn: Callable, mask_fn: Callable, caller: str) -> None:
    """Register ``attention_fn`` and ``mask_fn`` under ``name`` with transformers, after checking
    that the installed transformers is at least :data:`MIN_TRANSFORMERS`."""
    need = f"dikkat.hf.{caller} needs transformers ≥ {MIN_TRANSFORMERS}"
    fix = f"pip install 'transformers>={MIN_TRANSFORMERS}'"
    try:  # transformers is an optional dependency, imported only when it is used
        import transformers
    except ImportError as error:
        raise ImportError(f"{need}, which is not installed: {fix}") from error
    from packaging.version import Version  # a dependency of transformers

    installed = transformers.__version__
    if Version(installed) < Version(MIN_TRANSFORMERS):
        # what older releases do differently: docs/hf.md, "Which transformers"
        raise ImportError(f"{need}, but transformers {installed} is installed: {fix}")
    transformers.AttentionInterface.register(name, attention_fn)
    transformers.AttentionMaskInterface.register(name, mask_fn)


@functools.cache
def attention_function(backend: str = "auto") -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The function ``AttentionInterface`` calls, running ``dikkat.attention`` on ``backend``
    (one function object per backend).

    When the layer passes ``output_attentions=True`` (Llama, BERT and most models of
    transformers 5 do; GPT-2 does not — :func:`dikkat.capture` serves every model), the
    weights (B, H, T, S) are recomputed after the call from q and k
    (:func:`dikkat.attention_weights` with ``lse=None``, each row's log-sum-exp taken from its own
    scores, so the backend the call chose stays the same): the softmax's, before dropout, as
    eager's at evaluation.
    """
    check_backend_name("backend", backend, exact_only=True)

    def dikkat_attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: HFMask | Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        check_keywords(_layer(module), kwargs, attention_mask is not None)
        mask, bias, q_offset = _mask_and_bias(module, query, key, attention_mask, kwargs)
        shape = (query.shape[0], query.shape[2], key.shape[2])  # (B, T, S)
        mask = with_indices(_layer(module), mask, kwargs.get("indices"), shape, q_offset)
        bias = _with_position_bias(bias, kwargs.get("position_bias"))
        softcap = kwargs.get("softcap")  # Gemma 2's attn_logit_softcapping
        sinks = hf_sinks(kwargs)  # gpt-oss's s_aux (H,), or sinks (B, H, T, 1) → (B, H, T)
        _record(
            module, backend, query, key, value, mask,
            bias=bias, q_offset=q_offset, softcap=softcap, sinks=sinks,
        )  # fmt: skip
        out = attention(
            query,
            key,
            value,
            mask,
            scale=scaling,
            bias=bias,
            q_offset=q_offset,
            dropout=dropout,
            softcap=softcap,
            sinks=sinks,
            backend=backend,
        )  # (B, H, T, Dv)
        weights = None
        if kwargs.get("output_attentions"):
            with torch.no_grad():  # eager's weights carry gradient; these are for looking at
                weights = attention_weights(
                    query.detach(), key.detach(), None, mask=mask, scale=scaling,
                    bias=None if bias is None else bias.detach(), q_offset=q_offset,
                    softcap=softcap, sinks=None if sinks is None else sinks.detach(),
                ).to(value.dtype)  # fmt: skip
        return out.transpose(1, 2).contiguous(), weights  # (B, T, H, Dv), (B, H, T, S) | None

    dikkat_attention.__qualname__ = f"dikkat_attention[{backend}]"
    return dikkat_attention


def _mask_and_bias(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    attention_mask: HFMask | Tensor | None,
    kwargs: dict[str, Any],
) -> tuple[Mask | Tensor | None, Tensor | None, int]:
    """(dikkat mask, additive bias, q_offset) from what a layer passed as ``attention_mask``."""
    B, T, S = query.shape[0], query.shape[-2], key.shape[-2]
    if isinstance(attention_mask, HFMask):
        built = (attention_mask.batch, attention_mask.q_length, attention_mask.kv_length)
        if built[1:] != (T, S) or built[0] not in (1, B):
            raise ValueError(
                f"the attention mask was built for (B, T, S) = {built} but "
                f"{type(module).__name__} attends with (B, T, S) = {(B, T, S)}"
            )
        return attention_mask.mask, None, attention_mask.q_offset
    if attention_mask is None:
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", False)
        if causal:
            name = getattr(getattr(module, "config", None), "_attn_implementation", None)
            raise ValueError(
                f"dikkat received no attention mask for the causal layer {type(module).__name__} "
                f"(layer_idx={getattr(module, 'layer_idx', None)}): transformers passes none "
                f"when no mask function is registered under attn_implementation={name!r}, and "
                "without one every query would see the future. Register with "
                "dikkat.hf.register(name), which registers both functions."
            )
        return None, None, 0
    if isinstance(attention_mask, Tensor):  # a 4-D mask the caller built, passed through
        if attention_mask.dtype.is_floating_point:
            return None, attention_mask, 0  # additive, as transformers' eager attention adds it
        return attention_mask, None, 0  # bool: True = may attend, as dikkat's
    raise TypeError(
        f"attention_mask must be dikkat's HFMask, a tensor or None, got "
        f"{type(attention_mask).__name__}: was the model's mask function registered by "
        "dikkat.hf.register?"
    )


def _with_position_bias(bias: Tensor | None, position_bias: Tensor | None) -> Tensor | None:
    """The call's additive bias with T5's ``position_bias`` (1 or B, H, T, S) added. T5's eager
    attention adds it to the scores (its scaling is 1.0) beside the mask rather than folded into
    it, so it becomes dikkat's ``bias`` (checked there) and the mask stays a dikkat mask whose key
    ranges the tiled backend skips by."""
    if position_bias is None:
        return bias
    return position_bias if bias is None else position_bias + bias
