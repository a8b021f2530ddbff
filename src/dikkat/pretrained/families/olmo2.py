"""OLMo 2 (llama.cpp's ``olmo2``, transformers' ``Olmo2ForCausalLM``): Llama's attention and
SwiGLU MLP with the norms moved after them — each part reads x itself and its output is
RMSNorm-ed before the residual — and an RMSNorm over all heads' queries (and keys) at once,
before they are split into heads and rotated. Its GGUF files store q and k in RoPE's halves
("NEOX" rope), read as they are. OLMo 3's sliding layers (a ``sliding_window`` in either
format) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dikkat.models.decoder import Decoder, DecoderConfig
from dikkat.pretrained.families.base import Family, Tensors, Values, Weight
from dikkat.pretrained.families.common import (
    ATTENTION,
    MLP,
    MODEL,
    all_full,
    biases,
    decoder_config,
    gguf_fields,
    hf_fields,
)

__all__ = ["FAMILY"]

_NORMS = (
    Weight("attn.q_norm", "attn_q_norm", "self_attn.q_norm"),
    Weight("attn.k_norm", "attn_k_norm", "self_attn.k_norm"),
    Weight("post_attn_norm", "post_attention_norm", "post_attention_layernorm"),
    Weight("post_mlp_norm", "post_ffw_norm", "post_feedforward_layernorm"),
)
TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *_NORMS))
_OLMO2 = dict(qk_norm=True, qk_norm_scope="width", pre_norm=False, sandwich_norm=True)


def config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
) -> DecoderConfig:
    if meta.get("olmo2.attention.sliding_window"):
        raise ValueError(f"{source}: OLMo 3's sliding layers are not implemented in dikkat")
    fields = gguf_fields("olmo2", TENSORS, meta, shapes, values, source)
    return decoder_config(fields | biases(TENSORS, shapes) | _OLMO2, source)


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    if hf.get("sliding_window") is not None:
        raise ValueError(f"{source}: OLMo 3's sliding layers are not implemented in dikkat")
    bias = bool(hf.get("attention_bias", False))
    fields = hf_fields(hf, source, "olmo2", kinds=all_full)
    return DecoderConfig(**fields, qkv_bias=bias, out_bias=bias, **_OLMO2)


FAMILY = Family(
    name="olmo2",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="olmo2",
    hf_model_types=("olmo2",),
    hf_refused={"olmo3": "OLMo 3's sliding layers are not implemented in dikkat"},
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
)
