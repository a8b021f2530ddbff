"""Phi-3 and Phi-3.5 mini (llama.cpp's ``phi3``, transformers' ``Phi3ForCausalLM``): Llama's
block with q, k and v stored as one matrix (``qkv_proj``, GGUF ``attn_qkv``) and gate and up as
one (``gate_up_proj``, GGUF ``ffn_up``: gate's rows, then up's), held fused as they are stored;
and a sliding window on every layer where the files give one (Phi-3-mini-4k's 2047).

llama.cpp does not apply Phi-3's window (``src/models/phi3.cpp`` switches it off, llama.cpp
pull request 13676): past 2047 tokens its answers are not transformers' — dikkat's are. The
converter writes the window as the ``phi3.attention.sliding_window`` key (0: none, Phi-4).
The long-context models' LongRoPE (``rope_factors_long``/``_short`` tensors, ``rope_type
longrope``) and Phi-4-mini's RoPE on part of each head are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dikkat.models.decoder import Decoder, DecoderConfig
from dikkat.pretrained.families.base import Family, Tensors, Values, Weight
from dikkat.pretrained.families.common import (
    LLAMA_NORMS,
    MODEL,
    decoder_config,
    gguf_fields,
    hf_fields,
)
from dikkat.pretrained.families.mistral import every_layer_sliding
from dikkat.pretrained.gguf_checks import header_int

__all__ = ["FAMILY"]

TENSORS = Tensors(
    model=MODEL,
    layer=(
        Weight("attn.qkv_proj", "attn_qkv", "self_attn.qkv_proj"),
        Weight("attn.out_proj", "attn_output", "self_attn.o_proj"),
        Weight("mlp.gate_up", "ffn_up", "mlp.gate_up_proj"),
        Weight("mlp.down", "ffn_down", "mlp.down_proj"),
        *LLAMA_NORMS,
    ),
)
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


def config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
) -> DecoderConfig:
    if any(name in shapes for name in _LONGROPE):
        raise ValueError(
            f"{source}: LongRoPE scaling (rope_factors_long) is not implemented in dikkat"
        )
    d_model = header_int(meta, "phi3.embedding_length", source)
    n_heads = header_int(meta, "phi3.attention.head_count", source)
    rotated = meta.get("phi3.rope.dimension_count")
    if rotated is not None and rotated != d_model // n_heads:
        raise ValueError(
            f"{source}: RoPE on {rotated} of each head's {d_model // n_heads} features "
            "(partial rotary, Phi-4-mini) is not implemented in dikkat"
        )
    fields = gguf_fields("phi3", TENSORS, meta, shapes, values, source)
    window = header_int(meta, "phi3.attention.sliding_window", source, default=0, at_least=0)
    sliding = {"sliding_window": window} if window else {}
    return decoder_config(fields | sliding, source)


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    fields = hf_fields(hf, source, "phi3", kinds=every_layer_sliding)
    return DecoderConfig(**fields)


FAMILY = Family(
    name="phi3",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="phi3",
    hf_model_types=("phi3",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
)
