"""Mistral (transformers' ``MistralForCausalLM``): Llama with a sliding window on every layer.
Read from HF folders only: llama.cpp's converter writes Mistral's GGUF files as the ``llama``
architecture (:mod:`dikkat.pretrained.families.llama` reads them); Mistral's Tekken tokenizer,
which such files name, is declared here.
"""

from __future__ import annotations

from typing import Any

from dikkat.models.decoder import Decoder, LayerKind
from dikkat.pretrained.families.base import Family, PreSplit, Tensors
from dikkat.pretrained.families.common import ATTENTION, LLAMA_NORMS, MLP, MODEL, llama_hf_config

__all__ = ["FAMILY", "every_layer_sliding"]


def every_layer_sliding(hf: dict[str, Any], n_layers: int) -> tuple[LayerKind, ...]:
    """Every layer sliding where the config gives a window."""
    return ("full" if hf.get("sliding_window") is None else "sliding",) * n_layers


# Tekken's expression (llama.cpp's "tekken", src/llama-vocab.cpp)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

FAMILY = Family(
    name="mistral",
    model=Decoder,
    tensors=Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *LLAMA_NORMS)),
    hf_model_types=("mistral",),
    config_from_hf=llama_hf_config("mistral", every_layer_sliding),
    pre_splits={"tekken": PreSplit(TEKKEN_SPLIT)},
)
