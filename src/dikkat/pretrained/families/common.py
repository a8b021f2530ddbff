"""What the Llama-derived families (Llama, Mistral, Qwen2, Gemma 3) share: the GGUF header keys
and ``config.json`` keys of a :class:`~dikkat.models.DecoderConfig`, and Llama's tensor names,
which the others extend.

GGUF names follow llama.cpp's convention (``blk.{i}.attn_q.weight``, gguf-py's
``tensor_mapping.py``); HF names follow transformers' modeling files. Anything a file may hold
that dikkat does not implement (biases in the MLP, kinds of RoPE scaling but linear and llama3:
``rope_scaling.py``) is refused by name, never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dikkat.models.decoder import DecoderConfig, LayerKind
from dikkat.pretrained.families.base import Config, FromGGUF, FromHF, Tensors, Values, Weight
from dikkat.pretrained.families.rope_scaling import gguf_rope_factors, hf_rope_fields, rope_bases
from dikkat.pretrained.gguf_checks import (
    block_count,
    check_shape,
    header_float,
    header_int,
    vocab_rows,
)

__all__ = [
    "ATTENTION",
    "LLAMA_NORMS",
    "MLP",
    "MODEL",
    "all_full",
    "biases",
    "decoder_config",
    "gguf_fields",
    "hf_fields",
    "llama_gguf_config",
    "llama_hf_config",
]

# where a GGUF header gives the head dimension, the first present wins (Gemma 3: key_length)
_HEAD_DIM_KEYS = ("attention.key_length", "rope.dimension_count")
# a family's rule for each layer's kind where config.json lists no layer_types:
# (config.json, n_layers) → kinds
KindsRule = Callable[[dict[str, Any], int], tuple[LayerKind, ...]]


def _untied(c: Config) -> bool:
    return not c.tie_embeddings


def _qkv_bias(c: Config) -> bool:
    return c.qkv_bias


def _out_bias(c: Config) -> bool:
    return c.out_bias


# Llama's tensors (llama.cpp's LLM_ARCH_LLAMA, transformers' LlamaForCausalLM)
MODEL = (
    Weight("tok_emb", "token_embd", "model.embed_tokens"),
    Weight("norm_f", "output_norm", "model.norm"),
    Weight("lm_head", "output", "lm_head", when=_untied),
)
ATTENTION = (
    Weight("attn.q_proj", "attn_q", "self_attn.q_proj", bias=_qkv_bias),
    Weight("attn.k_proj", "attn_k", "self_attn.k_proj", bias=_qkv_bias),
    Weight("attn.v_proj", "attn_v", "self_attn.v_proj", bias=_qkv_bias),
    Weight("attn.out_proj", "attn_output", "self_attn.o_proj", bias=_out_bias),
)
MLP = (
    Weight("mlp.gate", "ffn_gate", "mlp.gate_proj"),
    Weight("mlp.up", "ffn_up", "mlp.up_proj"),
    Weight("mlp.down", "ffn_down", "mlp.down_proj"),
)
# Llama's "post_attention" norm is the one before the MLP
LLAMA_NORMS = (
    Weight("attn_norm", "attn_norm", "input_layernorm"),
    Weight("mlp_norm", "ffn_norm", "post_attention_layernorm"),
)


def gguf_fields(
    label: str,
    tensors: Tensors,
    meta: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    values: Values,
    source: str,
) -> dict[str, Any]:
    """The :class:`DecoderConfig` fields every Llama-derived GGUF header gives (its keys under
    ``general.architecture``), ``family`` = ``label``; ``tensors`` is the family's table.
    ``shapes`` (the file's tensors, name → torch shape) tell tying, ``values`` reads a small
    tensor that configures the model (RoPE's ``rope_freqs``), and ``shapes`` hold the header's sizes
    to the tensors they describe
    (:mod:`dikkat.pretrained.gguf_checks`): the block count, the vocabulary, the widths and
    head counts of the embedding and of block 0 — which bounds every size the model is built
    with by a tensor the file really holds."""
    arch = str(meta.get("general.architecture"))
    key = f"{arch}.{{}}".format
    if isinstance(meta.get(key("attention.head_count_kv")), list):  # per layer (hybrid models)
        raise ValueError(f"{source}: per-layer key/value head counts are not supported")
    n_layers = block_count(meta, key("block_count"), shapes, source)
    n_heads = header_int(meta, key("attention.head_count"), source)
    kv = header_int(meta, key("attention.head_count_kv"), source, default=n_heads)
    d_model = header_int(meta, key("embedding_length"), source)
    d_ff = header_int(meta, key("feed_forward_length"), source)
    embedding = tensors.gguf_name("tok_emb")
    vocab = vocab_rows(meta, arch, shapes, source, embedding)
    head_key = next((k for k in map(key, _HEAD_DIM_KEYS) if meta.get(k)), None)
    head_dim = None if head_key is None else header_int(meta, head_key, source)
    D = head_dim or d_model // n_heads
    width = f"{key('embedding_length')} = {d_model}"
    heads = f"heads of {D} ({head_key or f'{width} / heads'}) and {width}"
    for name, rows, why in (
        (embedding, vocab, f"the vocabulary of {vocab} tokens and {width}"),
        ("attn.q_proj", n_heads * D, f"{key('attention.head_count')} = {n_heads} {heads}"),
        ("attn.k_proj", kv * D, f"{key('attention.head_count_kv')} = {kv} {heads}"),
        ("mlp.up", d_ff, f"{key('feed_forward_length')} = {d_ff} and {width}"),
    ):
        if name != embedding and not tensors.stores(name):
            continue  # stored fused (Phi-3's qkv, gate_up): its shape is held to the model's
        name = name if name == embedding else tensors.gguf_name(name, 0)
        check_shape(shapes, name, (rows, d_model), why, source)
    fields: dict[str, Any] = dict(
        family=label,
        vocab_size=vocab,
        max_len=header_int(meta, key("context_length"), source),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=kv,
        d_ff=d_ff,
        norm_eps=header_float(meta, key("attention.layer_norm_rms_epsilon"), source),
        rope_base=header_float(meta, key("rope.freq_base"), source, default=10000.0),
        rope_factors=gguf_rope_factors(meta, shapes, values, D, source),
        attn_softcap=_cap(meta, key("attn_logit_softcapping"), source),
        final_softcap=_cap(meta, key("final_logit_softcapping"), source),
        tie_embeddings=tensors.gguf_name("lm_head") not in shapes,
    )
    if head_dim is not None and head_dim != d_model // n_heads:
        fields["head_dim"] = head_dim
    return fields


def _cap(meta: Mapping[str, Any], key: str, source: str) -> float | None:
    """A soft-capping header key's value (Gemma 2); None where it is absent."""
    return None if meta.get(key) is None else header_float(meta, key, source)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def biases(tensors: Tensors, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, bool]:
    """``qkv_bias`` and ``out_bias``: whether block 0 of a GGUF file stores those biases."""

    def stored(ours: str) -> bool:
        return tensors.gguf_name(ours, 0, "bias") in shapes

    return {"qkv_bias": stored("attn.q_proj"), "out_bias": stored("attn.out_proj")}


def llama_gguf_config(label: str, tensors: Tensors, **fixed: Any) -> FromGGUF:
    """The GGUF mapping of a Llama-shaped family (``tensors``: its table): :func:`gguf_fields`,
    with the attention biases that block 0 stores, and the family's ``fixed`` fields (Qwen 3's
    ``qk_norm=True``)."""

    def config_from_gguf(
        meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
    ) -> DecoderConfig:
        fields = gguf_fields(label, tensors, meta, shapes, values, source)
        return decoder_config(fields | biases(tensors, shapes) | fixed, source)

    return config_from_gguf


def llama_hf_config(label: str, kinds: KindsRule, **fixed: Any) -> FromHF:
    """The ``config.json`` mapping of a Llama-shaped family: :func:`hf_fields`, with biases on
    the four attention projections where ``attention_bias`` says, and the ``fixed`` fields."""

    def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
        bias = bool(hf.get("attention_bias", False))
        fields = hf_fields(hf, source, label, kinds=kinds)
        return DecoderConfig(**fields, qkv_bias=bias, out_bias=bias, **fixed)

    return config_from_hf


def decoder_config(fields: dict[str, Any], source: str) -> DecoderConfig:
    """The config of a GGUF header's ``fields``; sizes that cannot be together are refused
    naming the file."""
    try:
        return DecoderConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: the GGUF header's sizes do not make a model: {e}") from None


def hf_fields(
    hf: dict[str, Any],
    source: str,
    label: str,
    *,
    activation: str = "silu",
    kinds: KindsRule,
    tied: bool = False,
) -> dict[str, Any]:
    """The :class:`DecoderConfig` fields every Llama-derived ``config.json`` gives,
    ``family`` = ``label``: ``activation`` is transformers' name of the one activation the
    family has, ``kinds`` its rule for the layers' kinds where the config lists no
    ``layer_types``, ``tied`` its default for ``tie_word_embeddings``."""
    _refuse_unsupported(hf, source, activation)

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"{source}: config.json has no {key!r}")
        return hf[key]

    n_heads, d_model = int(need("num_attention_heads")), int(need("hidden_size"))
    n_layers = int(need("num_hidden_layers"))
    head_dim = hf.get("head_dim")
    D = int(head_dim or d_model // n_heads)
    bases = rope_bases(hf)
    listed = _layer_kinds(hf, n_layers)
    layer_kinds = kinds(hf, n_layers) if listed is None else listed
    window = hf.get("sliding_window") if "sliding" in layer_kinds else None
    return dict(
        family=label,
        vocab_size=int(need("vocab_size")),
        max_len=int(need("max_position_embeddings")),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=None if head_dim in (None, d_model // n_heads) else int(head_dim),
        d_ff=int(need("intermediate_size")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_base=bases.get("full_attention", 10000.0),
        **hf_rope_fields(hf, D, source),
        attn_softcap=_float_or_none(hf.get("attn_logit_softcapping")),
        final_softcap=_float_or_none(hf.get("final_logit_softcapping")),
        sliding_window=None if window is None else int(window),
        layer_kinds=layer_kinds if "sliding" in layer_kinds else None,
        tie_embeddings=bool(hf.get("tie_word_embeddings", tied)),
    )


def _refuse_unsupported(hf: dict[str, Any], source: str, expected: str) -> None:
    act = hf.get("hidden_act") or hf.get("hidden_activation")
    if act not in (None, expected):
        raise ValueError(f"{source}: activation {act!r} is not implemented (expected {expected!r})")
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=True is not implemented in dikkat")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=True is not implemented")


def _layer_kinds(hf: dict[str, Any], n_layers: int) -> tuple[LayerKind, ...] | None:
    """Each layer's kind where the config lists ``layer_types``; None where it does not."""
    types = hf.get("layer_types")
    if types is None:
        return None
    named = {"full_attention": "full", "sliding_attention": "sliding"}
    unknown = sorted(set(types) - set(named))
    if unknown or len(types) != n_layers:
        raise ValueError(f"layer_types {types} is not one kind per layer of {named}")
    return tuple(named[t] for t in types)  # type: ignore[misc]


def all_full(hf: dict[str, Any], n_layers: int) -> tuple[LayerKind, ...]:
    """Llama's rule: no sliding layers."""
    return ("full",) * n_layers
