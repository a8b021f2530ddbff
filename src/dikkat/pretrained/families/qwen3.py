"""Qwen 3, its dense models (llama.cpp's ``qwen3``, transformers' ``Qwen3ForCausalLM``): Llama
with an RMSNorm on each head's queries and keys before RoPE (as Gemma 3), no biases on the
projections, and heads whose width is its own (``head_dim``, 128 where the width over the heads
would give 64 in Qwen3-0.6B). Its GGUF files store q and k in RoPE's halves already ("NEOX"
rope), read as they are; its tokenizers are Qwen 2's (``tokenizer.ggml.pre`` ``qwen2``).
"""

from __future__ import annotations

from dikkat.models.decoder import Decoder
from dikkat.pretrained.families.base import Family, Tensors, Weight
from dikkat.pretrained.families.common import (
    ATTENTION,
    LLAMA_NORMS,
    MLP,
    MODEL,
    llama_gguf_config,
    llama_hf_config,
)
from dikkat.pretrained.families.qwen2 import window_layers

__all__ = ["FAMILY", "QK_NORMS"]

QK_NORMS = (
    Weight("attn.q_norm", "attn_q_norm", "self_attn.q_norm"),
    Weight("attn.k_norm", "attn_k_norm", "self_attn.k_norm"),
)
TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *LLAMA_NORMS, *QK_NORMS))

FAMILY = Family(
    name="qwen3",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="qwen3",
    hf_model_types=("qwen3",),
    config_from_gguf=llama_gguf_config("qwen3", TENSORS, qk_norm=True),
    config_from_hf=llama_hf_config("qwen3", window_layers, qk_norm=True),
)
