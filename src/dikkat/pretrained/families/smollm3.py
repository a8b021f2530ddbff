"""SmolLM3 (llama.cpp's ``smollm3``, transformers' ``SmolLM3ForCausalLM``): Llama whose every
fourth layer has no RoPE ("NoPE": attention there sees no positions but through the causal
mask). llama.cpp fixes the step at four (``n_no_rope_layer_step``); a ``config.json`` lists each
layer (``no_rope_layers``: 1 where RoPE is used, 0 where not). Its converter is Llama's, so a
GGUF file's q and k rows are interleaved as Llama's are and put back the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dikkat.models.decoder import Decoder, DecoderConfig
from dikkat.pretrained.families.base import Family, Tensors, Values
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
from dikkat.pretrained.families.llama import from_gguf
from dikkat.pretrained.families.qwen2 import window_layers

__all__ = ["FAMILY"]

NOPE_STEP = 4  # llama.cpp's n_no_rope_layer_step for LLM_ARCH_SMOLLM3
TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *LLAMA_NORMS))


def config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
) -> DecoderConfig:
    fields = gguf_fields("smollm3", TENSORS, meta, shapes, values, source)
    nope = tuple(i for i in range(fields["n_layers"]) if (i + 1) % NOPE_STEP == 0)
    return decoder_config(fields | biases(TENSORS, shapes) | {"nope_layers": nope}, source)


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    bias = bool(hf.get("attention_bias", False))
    fields = hf_fields(hf, source, "smollm3", kinds=window_layers)
    n, step = fields["n_layers"], int(hf.get("no_rope_layer_interval", NOPE_STEP))
    uses = hf.get("no_rope_layers") or [int((i + 1) % step != 0) for i in range(n)]
    if len(uses) != n:
        raise ValueError(f"{source}: no_rope_layers {uses} does not give each of {n} layers")
    nope = tuple(i for i, use in enumerate(uses) if not use)
    return DecoderConfig(**fields, qkv_bias=bias, out_bias=bias, nope_layers=nope)


FAMILY = Family(
    name="smollm3",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="smollm3",
    hf_model_types=("smollm3",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    gguf_fix=from_gguf,
)
