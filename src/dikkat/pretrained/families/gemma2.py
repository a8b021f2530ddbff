"""Gemma 2 (llama.cpp's ``gemma2``, transformers' ``Gemma2ForCausalLM``): Gemma 3's block — GeGLU,
norms before and after attention and MLP, embeddings scaled by √C, a tied output layer —
without q/k norms, with every other layer sliding (the first of each pair), one RoPE base for
both kinds, and soft-capping: the attention scores and the final logits bounded to ±c by
c · tanh(x / c) (``attn_logit_softcapping`` 50, ``final_logit_softcapping`` 30).

Gemma scales by ``1 + w`` in its RMSNorms: llama.cpp's converter stores ``1 + w``, an HF folder
``w`` (:func:`dikkat.pretrained.families.gemma3.from_hf` adds 1). The attention's scale is
``1/√query_pre_attn_scalar`` from a ``config.json``; a GGUF header does not carry it, and
llama.cpp takes ``1/√(C/H)`` for the 27B model (46 layers) and ``1/√D`` for the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dikkat.models.decoder import Decoder, DecoderConfig, LayerKind, gemma3_layer_kinds
from dikkat.pretrained.families.base import Family, Tensors, Values
from dikkat.pretrained.families.common import (
    ATTENTION,
    MLP,
    MODEL,
    decoder_config,
    gguf_fields,
    hf_fields,
)
from dikkat.pretrained.families.gemma3 import SANDWICH_NORMS, from_hf
from dikkat.pretrained.gguf_checks import header_int

__all__ = ["FAMILY"]

PATTERN = 2  # one full layer in every two: llama.cpp's load_swa_pattern(ml, 2)
TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *SANDWICH_NORMS))
_GEMMA = dict(activation="gelu_tanh", sandwich_norm=True, embed_scale=True)


def config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
) -> DecoderConfig:
    f = gguf_fields("gemma2", TENSORS, meta, shapes, values, source)
    n_layers, n_heads, d_model = f["n_layers"], f["n_heads"], f["d_model"]
    D = f.get("head_dim") or d_model // n_heads
    scalar = d_model / n_heads if n_layers == 46 else D
    window = header_int(meta, "gemma2.attention.sliding_window", source, default=4096)
    kinds = gemma3_layer_kinds(n_layers, PATTERN)
    extra = dict(sliding_window=window, layer_kinds=kinds, attn_scale=scalar**-0.5)
    return decoder_config(f | _GEMMA | extra, source)


def _kinds(hf: dict[str, Any], n_layers: int) -> tuple[LayerKind, ...]:
    return gemma3_layer_kinds(n_layers, PATTERN)


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    fields = hf_fields(
        hf, source, "gemma2", activation="gelu_pytorch_tanh", kinds=_kinds, tied=True
    )
    scale = float(hf.get("query_pre_attn_scalar", 256)) ** -0.5
    return DecoderConfig(**fields, **_GEMMA, attn_scale=scale)


FAMILY = Family(
    name="gemma2",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="gemma2",
    hf_model_types=("gemma2",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    hf_fix=from_hf,
)
