"""Qwen 3, its dense models (llama.cpp's ``qwen3``, transformers' ``Qwen3ForCausalLM``): Llama
with an RMSNorm on each head's queries and keys before RoPE (as Gemma 3), no biases on the
projections, and heads whose width is its own (``head_dim``, 128 where the width over the heads
would give 64 in Qwen3-0.6B). Its GGUF files store q and k in RoPE's halves already ("NEOX"
rope), read as they are; its tokenizers are Qwen 2's (``tokenizer.ggml.pre`` ``qwen2``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dikkat.models.decoder import Decoder, DecoderConfig
from dikkat.pretrained.families.base import Family, Tensors, Values, Weight
from dikkat.pretrained.families.common import (
    ATTENTION,
    LLAMA_NORMS,
    MLP,
    MODEL,
    biases,
    decoder_config,
    gguf_fields,
    hf_fields,
)
from dikkat.pretrained.families.qwen2 import window_layers

__all__ = ["FAMILY"]

QK_NORMS = (
    Weight("attn.q_norm", "attn_q_norm", "self_attn.q_norm"),
    Weight("attn.k_norm", "attn_k_norm", "self_attn.k_norm"),
)
TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *LLAMA_NORMS, *QK_NORMS))


def config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
) -> DecoderConfig:
    fields = gguf_fields("qwen3", TENSORS, meta, shapes, values, source)
    return decoder_config(fields | biases(TENSORS, shapes) | {"qk_norm": True}, source)


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    bias = bool(hf.get("attention_bias", False))
    fields = hf_fields(hf, source, "qwen3", kinds=window_layers)
    return DecoderConfig(**fields, qkv_bias=bias, out_bias=bias, qk_norm=True)


FAMILY = Family(
    name="qwen3",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="qwen3",
    hf_model_types=("qwen3",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
)
