"""RoPE's settings as a family's files state them: the base of each kind of layer, and the
scaling of the full-attention layers' frequencies (:class:`~dikkat.layers.RotaryEmbedding`'s
``factors``, one divisor per frequency).

Two kinds of scaling are implemented, in both formats:

- ``linear`` (position interpolation, Chen et al. 2023, arXiv:2306.15595): every frequency
  divided by one factor. transformers: ``rope_type="linear"``; GGUF: ``rope.scaling.type =
  linear`` and ``rope.scaling.factor``.
- ``llama3`` (Llama 3.1 and every later Llama): long waves divided, short ones kept, a blend
  between (:func:`~dikkat.layers.llama3_rope_factors`). transformers: ``rope_type="llama3"``
  with its four numbers; GGUF: the divisors themselves, as the ``rope_freqs`` tensor that
  llama.cpp's converter computes (``convert_hf_to_gguf.py``, ``LlamaModel``).

- ``longrope`` (LongRoPE, Phi-3's 128k models and Phi-4-mini): short and long divisors, the long
  ones for a sequence past the original context, and cos and sin scaled (:func:`hf_rope_fields`;
  GGUF: the ``rope_factors_short``/``_long`` tensors, ``rope.scaling.attn_factor`` and
  ``rope.scaling.original_context_length``, read by the ``phi3`` family).

Any other kind (YaRN, dynamic NTK) is refused by name: positions past the trained context would
be wrong, not merely different.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from dikkat.layers.positional import as_rope_factors, llama3_rope_factors
from dikkat.pretrained.gguf_file import shown

__all__ = ["ROPE_FREQS", "gguf_rope_factors", "hf_rope_factors", "hf_rope_fields", "rope_bases"]

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (LLM_TENSOR_ROPE_FREQS)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _per_kind(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE's parameters of each kind of layer ("full_attention", "sliding_attention") from
    either layout of transformers' config: ``rope_parameters`` (transformers 5; per kind for
    Gemma 3) or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params, scaling = hf.get("rope_parameters"), dict(hf.get("rope_scaling") or {})
    if "type" in scaling:  # the older name of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    if params is None:
        kinds = {"full_attention": {"rope_theta": float(hf.get("rope_theta", 10000.0)), **scaling}}
        if "rope_local_base_freq" in hf:
            kinds["sliding_attention"] = {"rope_theta": float(hf["rope_local_base_freq"])}
        return kinds
    if "rope_theta" not in params:  # per kind
        if scaling:
            raise ValueError(
                f"rope_scaling={scaling} beside rope_parameters of each kind of layer: which "
                "layers it scales is not said"
            )
        return dict(params)
    return {"full_attention": {**params, **scaling}}  # an older key written beside the newer


def _kind_of(p: Mapping[str, Any]) -> str:
    """A parameter set's scaling kind."""
    return str(p.get("rope_type", "default"))


def rope_bases(hf: dict[str, Any]) -> dict[str, float]:
    """RoPE base per layer kind ("full_attention", "sliding_attention") of a ``config.json``."""
    return {kind: float(p.get("rope_theta", 10000.0)) for kind, p in _per_kind(hf).items()}


def hf_rope_fields(hf: dict[str, Any], head_dim: int, source: str) -> dict[str, Any]:
    """The :class:`~dikkat.models.DecoderConfig` fields of RoPE a ``config.json`` describes
    beyond its base: ``rope_factors``; ``rotary_dim`` where ``partial_rotary_factor`` turns part
    of each head (Phi-4-mini); and LongRoPE's ``rope_long_factors``, ``rope_original_len`` and
    ``rope_mscale`` (``attention_factor``, else √(1 + ln s / ln L) for s = the context over the
    original context L, as transformers computes it)."""
    p = _per_kind(hf).get("full_attention", {})
    partial = float(p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotated = int(head_dim * partial)
    fields: dict[str, Any] = {} if rotated == head_dim else {"rotary_dim": rotated}
    if _kind_of(p) != "longrope":
        return fields | {"rope_factors": hf_rope_factors(hf, rotated, source)}
    original = p.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    missing = [k for k in ("short_factor", "long_factor") if p.get(k) is None]
    if original is None or missing:
        lacking = missing or ["original_max_position_embeddings"]
        raise ValueError(f"{source}: longrope RoPE scaling without {lacking}")
    factor = p.get("factor") or hf["max_position_embeddings"] / original
    mscale = p.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return fields | {
        "rope_factors": tuple(p["short_factor"]),
        "rope_long_factors": tuple(p["long_factor"]),
        "rope_original_len": int(original),
        "rope_mscale": float(mscale),
    }


def hf_rope_factors(hf: dict[str, Any], head_dim: int, source: str) -> tuple[float, ...] | None:
    """The full-attention layers' RoPE divisors a ``config.json`` describes (``head_dim``: the
    features RoPE turns); None: unscaled. Scaling of the sliding layers and any kind but
    ``linear``, ``llama3`` (and ``longrope``, :func:`hf_rope_fields`) are refused naming the
    key."""
    kinds = _per_kind(hf)
    for kind, p in kinds.items():
        if kind != "full_attention" and _kind_of(p) != "default":
            raise ValueError(
                f"{source}: RoPE scaling of the {kind} layers is not implemented in dikkat"
            )
    p = kinds.get("full_attention", {})
    kind, base = _kind_of(p), float(p.get("rope_theta", 10000.0))
    if kind == "default":
        return None
    if kind == "linear":
        return (float(p["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if p.get(k) is None]
        if missing:
            raise ValueError(f"{source}: llama3 RoPE scaling without {missing}")
        return llama3_rope_factors(
            head_dim,
            base,
            factor=float(p["factor"]),
            low_freq_factor=float(p["low_freq_factor"]),
            high_freq_factor=float(p["high_freq_factor"]),
            original_max_len=int(p["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"{source}: RoPE scaling {kind!r} is not implemented in dikkat (it runs linear, llama3 "
        "and longrope); positions past the trained context would be wrong"
    )


def gguf_rope_factors(
    meta: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    values: Callable[[str], Tensor],
    head_dim: int,
    source: str,
) -> tuple[float, ...] | None:
    """The full-attention layers' RoPE divisors a GGUF file describes: its ``rope_freqs``
    tensor (read through ``values``) times a linear ``rope.scaling.factor``, as llama.cpp
    multiplies them; None: unscaled."""
    key = f"{meta.get('general.architecture')}.rope.scaling.{{}}".format
    kind = meta.get(key("type"))
    factors: tuple[float, ...] | None = None
    if kind == "linear":
        factor = meta.get(key("factor"))
        if not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"{source}: {key('factor')} = {shown(factor)} is not a factor")
        factors = (float(factor),) * (head_dim // 2)
    elif kind not in (None, "none"):
        raise ValueError(
            f"{source}: RoPE scaling {shown(kind)} ({key('type')}) is not implemented in dikkat "
            "(it runs linear, and llama3's rope_freqs); positions past the trained context "
            "would be wrong"
        )
    if ROPE_FREQS in shapes:
        if shapes[ROPE_FREQS] != (head_dim // 2,):
            raise ValueError(
                f"{source}: {ROPE_FREQS} is {shapes[ROPE_FREQS]}, not one divisor for each of "
                f"the {head_dim // 2} frequencies of heads of {head_dim}"
            )
        stored = values(ROPE_FREQS).double().tolist()
        try:
            stored = list(as_rope_factors(stored, head_dim))
        except ValueError as e:
            raise ValueError(f"{source}: {ROPE_FREQS}: {e}") from None
        factors = tuple(a * b for a, b in zip(stored, factors or (1.0,) * len(stored), strict=True))
    return factors
