"""Qwen2 (llama.cpp's ``qwen2``, transformers' ``Qwen2ForCausalLM``): Llama with biases on the
q/k/v projections (none on the output), and sliding windows from layer ``max_window_layers`` on
where ``use_sliding_window`` says. Its GGUF files store q and k in RoPE's halves already
("NEOX" rope), so they are read as they are.
"""

from __future__ import annotations

from typing import Any

from dikkat.models.decoder import Decoder, DecoderConfig, LayerKind
from dikkat.pretrained.families.base import Family, PreSplit, Tensors
from dikkat.pretrained.families.common import (
    ATTENTION,
    LLAMA_NORMS,
    MLP,
    MODEL,
    hf_fields,
    llama_gguf_config,
)

__all__ = ["FAMILY", "window_layers"]


TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *LLAMA_NORMS))


def window_layers(hf: dict[str, Any], n_layers: int) -> tuple[LayerKind, ...]:
    """Sliding from layer ``max_window_layers`` on, where ``use_sliding_window`` is set."""
    if hf.get("sliding_window") is None or not hf.get("use_sliding_window"):
        return ("full",) * n_layers
    start = int(hf.get("max_window_layers", n_layers))
    return tuple("sliding" if i >= start else "full" for i in range(n_layers))


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    bias = bool(hf.get("attention_bias", False))
    fields = hf_fields(hf, source, "qwen2", kinds=window_layers)
    return DecoderConfig(**fields, qkv_bias=True, out_bias=bias)  # q/k/v biases always


# Qwen2's expression: Llama 3's with one digit a word (llama.cpp's "qwen2", src/llama-vocab.cpp)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

FAMILY = Family(
    name="qwen2",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="qwen2",
    hf_model_types=("qwen2",),
    config_from_gguf=llama_gguf_config("qwen2", TENSORS),
    config_from_hf=config_from_hf,
    pre_splits=dict.fromkeys(
        ("qwen2", "stablelm2", "deepseek-r1-qwen"), PreSplit(QWEN2_SPLIT, nfc=True)
    ),
)
