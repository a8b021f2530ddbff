"""Qwen3-MoE (llama.cpp's ``qwen3moe``, transformers' ``Qwen3MoeForCausalLM``: Qwen3-30B-A3B,
Qwen3-235B-A22B): Qwen 3's attention, and in every block a sparse mixture of experts in place
of the MLP (:class:`~dikkat.layers.SparseMoE`): a router picks ``num_experts_per_tok`` of
``num_experts`` gated MLPs for each token.

A GGUF file stores a block's experts stacked (``ffn_gate_exps``, ``ffn_up_exps`` (E, H, C);
``ffn_down_exps`` (E, C, H)) and the router as ``ffn_gate_inp``; a Hugging Face checkpoint stores
each expert's own ``gate_proj``/``up_proj``/``down_proj`` and the router as ``mlp.gate``.
llama.cpp renormalises the k picked probabilities for this architecture whatever the header
says (``src/models/qwen3moe.cpp``), as the released models' ``norm_topk_prob`` does; dikkat
reads ``expert_weights_norm`` where a header has it. Dense layers between sparse ones
(``mlp_only_layers``, ``decoder_sparse_step``), shared experts and any gating but the softmax
are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dikkat.models.decoder import Decoder, DecoderConfig
from dikkat.pretrained.families.base import Family, Tensors, Values, Weight
from dikkat.pretrained.families.common import (
    ATTENTION,
    LLAMA_NORMS,
    MODEL,
    biases,
    decoder_config,
    gguf_fields,
    hf_fields,
)
from dikkat.pretrained.families.qwen2 import window_layers
from dikkat.pretrained.families.qwen3 import QK_NORMS
from dikkat.pretrained.gguf_checks import check_shape, header_int

__all__ = ["FAMILY"]

EXPERTS = (
    Weight("mlp.router", "ffn_gate_inp", "mlp.gate"),
    # a GGUF file's stacks, which the model splits into its experts' weights
    Weight("mlp.experts.gate", "ffn_gate_exps"),
    Weight("mlp.experts.up", "ffn_up_exps"),
    Weight("mlp.experts.down", "ffn_down_exps"),
    # a Hugging Face checkpoint's, one of each expert
    Weight("mlp.experts.{e}.gate", None, "mlp.experts.{e}.gate_proj"),
    Weight("mlp.experts.{e}.up", None, "mlp.experts.{e}.up_proj"),
    Weight("mlp.experts.{e}.down", None, "mlp.experts.{e}.down_proj"),
)
TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *EXPERTS, *LLAMA_NORMS, *QK_NORMS))
_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
) -> DecoderConfig:
    key = "qwen3moe.{}".format
    hidden = meta.get(key("expert_feed_forward_length"))
    if isinstance(hidden, list):
        raise ValueError(f"{source}: experts of a width per layer are not implemented in dikkat")
    if header_int(meta, key("expert_shared_count"), source, default=0, at_least=0):
        raise ValueError(f"{source}: shared experts are not implemented in dikkat")
    gating = header_int(meta, key("expert_gating_func"), source, default=_SOFTMAX)
    if gating != _SOFTMAX:
        raise ValueError(
            f"{source}: {key('expert_gating_func')} = {gating}: experts gated by anything but "
            "the softmax are not implemented in dikkat"
        )
    scale = meta.get(key("expert_weights_scale"))
    if scale not in (None, 0, 0.0, 1, 1.0):
        raise ValueError(
            f"{source}: {key('expert_weights_scale')} = {scale}: scaled expert weights are not "
            "implemented in dikkat"
        )
    fields = gguf_fields("qwen3moe", TENSORS, meta, shapes, values, source)
    n_experts = header_int(meta, key("expert_count"), source)
    k = header_int(meta, key("expert_used_count"), source)
    H = header_int(meta, key("expert_feed_forward_length"), source)
    C = fields["d_model"]
    router = TENSORS.gguf_name("mlp.router", 0)
    check_shape(shapes, router, (n_experts, C), f"{key('expert_count')} = {n_experts}", source)
    gate = TENSORS.gguf_name("mlp.experts.gate", 0)
    why = f"{key('expert_feed_forward_length')} = {H} and {n_experts} experts"
    check_shape(shapes, gate, (n_experts, H, C), why, source)
    norm = meta.get(key("expert_weights_norm"), True)
    experts = dict(d_ff=H, n_experts=n_experts, experts_per_token=k, norm_topk=bool(norm))
    return decoder_config(fields | biases(TENSORS, shapes) | experts | {"qk_norm": True}, source)


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            f"{source}: dense layers among the sparse ones (mlp_only_layers "
            f"{hf.get('mlp_only_layers')}, decoder_sparse_step {hf.get('decoder_sparse_step')}) "
            "are not implemented in dikkat"
        )
    if hf.get("shared_expert_intermediate_size"):
        raise ValueError(f"{source}: shared experts are not implemented in dikkat")
    fields = hf_fields(hf, source, "qwen3moe", kinds=window_layers)
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if n_experts is None or hf.get("moe_intermediate_size") is None:
        raise ValueError(f"{source}: config.json has no num_experts or moe_intermediate_size")
    bias = bool(hf.get("attention_bias", False))
    return DecoderConfig(
        **fields | {"d_ff": int(hf["moe_intermediate_size"])},
        n_experts=int(n_experts),
        experts_per_token=int(hf.get("num_experts_per_tok", 0)),
        norm_topk=bool(hf.get("norm_topk_prob", False)),  # transformers' default
        qkv_bias=bias,
        out_bias=bias,
        qk_norm=True,
    )


FAMILY = Family(
    name="qwen3moe",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="qwen3moe",
    hf_model_types=("qwen3_moe",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
)
