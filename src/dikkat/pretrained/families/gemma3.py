"""Gemma 3, its text model (llama.cpp's ``gemma3``, transformers' ``Gemma3ForCausalLM``,
``model_type`` ``gemma3_text``): GeGLU, RMSNorms on each head's queries and keys, norms after
attention and after the MLP too ("sandwich"), embeddings scaled by √C, five sliding layers of
a local RoPE base to every full one, and a tied output layer.

Gemma scales by ``1 + w`` in its RMSNorms. llama.cpp's converter stores ``1 + w``, which is what
:class:`~dikkat.layers.RMSNorm` multiplies by; an HF folder stores ``w``, so 1 is added
(:func:`from_hf`). Its GGUF files store q and k in RoPE's halves already, read as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dikkat.models.decoder import Decoder, DecoderConfig, LayerKind, gemma3_layer_kinds
from dikkat.pretrained.families.base import Family, Tensors, Values, Weight
from dikkat.pretrained.families.common import (
    ATTENTION,
    MLP,
    MODEL,
    decoder_config,
    gguf_fields,
    hf_fields,
)
from dikkat.pretrained.families.rope_scaling import rope_bases
from dikkat.pretrained.gguf_checks import header_int

__all__ = ["FAMILY", "SANDWICH_NORMS", "from_hf"]

# Gemma 3 facts that its GGUF header does not carry (llama.cpp's llama-model.cpp hard-codes them
# for LLM_ARCH_GEMMA3, as transformers' Gemma3TextConfig defaults do): the RoPE base of the
# sliding layers, and one full-attention layer in every six.
LOCAL_ROPE_BASE = 10000.0
PATTERN = 6
_GEMMA = dict(activation="gelu_tanh", qk_norm=True, sandwich_norm=True, embed_scale=True)


# Gemma's "post_attention" norm is after attention, before the residual
SANDWICH_NORMS = (  # Gemma 2's too
    Weight("attn_norm", "attn_norm", "input_layernorm"),
    Weight("post_attn_norm", "post_attention_norm", "post_attention_layernorm"),
    Weight("mlp_norm", "ffn_norm", "pre_feedforward_layernorm"),
    Weight("post_mlp_norm", "post_ffw_norm", "post_feedforward_layernorm"),
)
_QK_NORMS = (
    Weight("attn.q_norm", "attn_q_norm", "self_attn.q_norm"),
    Weight("attn.k_norm", "attn_k_norm", "self_attn.k_norm"),
)
TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *_QK_NORMS, *SANDWICH_NORMS))


def config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
) -> DecoderConfig:
    f = gguf_fields("gemma3", TENSORS, meta, shapes, values, source)
    n_layers, n_heads, d_model = f["n_layers"], f["n_heads"], f["d_model"]
    D = f.get("head_dim") or d_model // n_heads
    # llama.cpp: 1/√(C/H) for the 27B model (query_pre_attn_scalar = C/H), 1/√D else
    scalar = d_model / n_heads if n_layers == 62 else D
    window = header_int(meta, "gemma3.attention.sliding_window", source)
    return decoder_config(
        f
        | _GEMMA
        | dict(
            local_rope_base=LOCAL_ROPE_BASE,
            sliding_window=window,
            layer_kinds=gemma3_layer_kinds(n_layers, PATTERN),
            attn_scale=scalar**-0.5,
        ),
        source,
    )


def _kinds(hf: dict[str, Any], n_layers: int) -> tuple[LayerKind, ...]:
    """One full layer in every ``sliding_window_pattern``."""
    return gemma3_layer_kinds(n_layers, int(hf.get("sliding_window_pattern", PATTERN)))


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    fields = hf_fields(
        hf, source, "gemma3", activation="gelu_pytorch_tanh", kinds=_kinds, tied=True
    )
    local = rope_bases(hf).get("sliding_attention", LOCAL_ROPE_BASE)
    return DecoderConfig(
        **fields,
        **_GEMMA,
        local_rope_base=local,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
    )


def from_hf(name: str, tensor: Tensor, config: DecoderConfig) -> Tensor:
    """The norm scales w become 1 + w (in fp32), as llama.cpp's converter stores them."""
    if "norm" in name.rsplit(".", 2)[-2]:
        return 1.0 + tensor.to(torch.float32)
    return tensor


FAMILY = Family(
    name="gemma3",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="gemma3",
    hf_model_types=("gemma3_text",),
    hf_refused={"gemma3": "a multimodal Gemma 3: dikkat runs its text model, gemma3_text"},
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    hf_fix=from_hf,
)
