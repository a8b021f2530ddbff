"""Phi-3 and Phi-3.5 mini (llama.cpp's ``phi3``, transformers' ``Phi3ForCausalLM``): Llama's
block with q, k and v stored as one matrix (``qkv_proj``, GGUF ``attn_qkv``) and gate and up as
one (``gate_up_proj``, GGUF ``ffn_up``: gate's rows, then up's), held fused as they are stored;
and a sliding window on every layer where the files give one (Phi-3-mini-4k's 2047).

llama.cpp does not apply Phi-3's window (``src/models/phi3.cpp`` switches it off, llama.cpp
pull request 13676): past 2047 tokens its answers are not transformers' — dikkat's are. The
converter writes the window as the ``phi3.attention.sliding_window`` key (0: none, Phi-4).

The long-context models' LongRoPE (``rope_type longrope``; GGUF: the ``rope_factors_long`` /
``_short`` tensors) and Phi-4-mini's RoPE on part of each head (``partial_rotary_factor``;
GGUF: ``rope.dimension_count``) are read into :class:`~dikkat.layers.RotaryEmbedding`. The long
divisors serve a sequence past the original context, as transformers picks them (by the
sequence's last position, row by row); llama.cpp picks them once, by the context size it is
given, so past that point the two differ.
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
from dikkat.pretrained.gguf_checks import header_float, header_int

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
    d_model = header_int(meta, "phi3.embedding_length", source)
    n_heads = header_int(meta, "phi3.attention.head_count", source)
    D = header_int(meta, "phi3.attention.key_length", source, default=d_model // n_heads)
    # rope.dimension_count is the features RoPE turns, not the head's width (Phi-4-mini: 96 of
    # 128): the head's width comes from the widths alone
    rotated = header_int(meta, "phi3.rope.dimension_count", source, default=D)
    heads = {k: v for k, v in meta.items() if k != "phi3.rope.dimension_count"}
    fields = gguf_fields("phi3", TENSORS, heads, shapes, values, source)
    if rotated != D:
        fields["rotary_dim"] = rotated
    if any(name in shapes for name in _LONGROPE):
        fields |= _longrope(meta, shapes, values, rotated, source)
    window = header_int(meta, "phi3.attention.sliding_window", source, default=0, at_least=0)
    sliding = {"sliding_window": window} if window else {}
    return decoder_config(fields | sliding, source)


def _longrope(
    meta: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    values: Values,
    rotated: int,
    source: str,
) -> dict[str, Any]:
    """LongRoPE's fields from the converter's tensors and keys."""
    for name in _LONGROPE:
        if shapes.get(name) != (rotated // 2,):
            raise ValueError(
                f"{source}: LongRoPE needs {name} of {rotated // 2} divisors (one for each "
                f"frequency RoPE turns), the file holds {shapes.get(name)}"
            )
    long, short = (values(name).double().tolist() for name in _LONGROPE)
    return {
        "rope_factors": tuple(short),
        "rope_long_factors": tuple(long),
        "rope_original_len": header_int(meta, "phi3.rope.scaling.original_context_length", source),
        "rope_mscale": header_float(meta, "phi3.rope.scaling.attn_factor", source, default=1.0),
    }


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
