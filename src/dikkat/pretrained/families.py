"""What each family's files call things: a :class:`~dikkat.models.DecoderConfig` from a GGUF
header or a Hugging Face ``config.json``, and each stored tensor's name in dikkat's state dict.

GGUF names follow llama.cpp's convention (``blk.{i}.attn_q.weight``, gguf-py's
``tensor_mapping.py``); HF names follow transformers' modeling files. Two conversions happen on
the way in:

- llama.cpp's converter permutes the rows of a Llama's q and k projections so that RoPE rotates
  adjacent pairs (GGML's "normal" rope); dikkat rotates halves (as the HF checkpoint does), so
  those rows are permuted back (``unpermute_rope_rows``). Qwen2 and Gemma 3 files are stored in
  the half-rotating layout already ("NEOX" rope) and are read as they are.
- Gemma scales by ``1 + w`` in its RMSNorms. llama.cpp's converter stores ``1 + w``, which is what
  :class:`~dikkat.layers.RMSNorm` multiplies by; an HF folder stores ``w``, so 1 is added.

Anything a family's files may hold that dikkat does not implement (RoPE scaling, logit
soft-capping, biases in the MLP) is refused by name, never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dikkat.models.decoder import DecoderConfig, LayerKind, gemma3_layer_kinds
from dikkat.pretrained.gguf_checks import (
    block_count,
    check_shape,
    header_float,
    header_int,
    vocab_rows,
)
from dikkat.pretrained.gguf_file import shown

__all__ = ["config_from_gguf", "config_from_hf", "gguf_names", "hf_names", "unpermute_rope_rows"]

GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3_text": "gemma3"}

# Gemma 3 facts that its GGUF header does not carry (llama.cpp's llama-model.cpp hard-codes them
# for LLM_ARCH_GEMMA3, as transformers' Gemma3TextConfig defaults do): the RoPE base of the
# sliding layers, and one full-attention layer in every six.
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_PATTERN = 6
# where a GGUF header gives the head dimension, the first present wins (Gemma 3: key_length)
_HEAD_DIM_KEYS = ("attention.key_length", "rope.dimension_count")


def config_from_gguf(
    meta: dict[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str
) -> DecoderConfig:
    """The config of the model a GGUF header describes. ``shapes`` (the file's tensors, name →
    torch shape) tell tying and biases, and hold the header's sizes to the tensors they describe
    (:mod:`dikkat.pretrained.gguf_checks`): the block count, the vocabulary, the widths and
    head counts of the embedding and of block 0 — which bounds every size the model is built
    with by a tensor the file really holds."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{source}: GGUF architecture {shown(arch)} is not one dikkat runs; it reads "
            f"{', '.join(GGUF_ARCHITECTURES)} and gpt2 (as a GPT)"
        )
    key = f"{arch}.{{}}".format
    scaling = meta.get(key("rope.scaling.type"))
    if scaling not in (None, "none") or "rope_freqs.weight" in shapes:
        raise ValueError(
            f"{source}: RoPE scaling ({shown(scaling or 'rope_freqs')}) is not implemented in "
            "dikkat; this model's long-context positions would be wrong"
        )
    if isinstance(meta.get(key("attention.head_count_kv")), list):  # per layer (hybrid models)
        raise ValueError(f"{source}: per-layer key/value head counts are not supported")
    n_layers = block_count(meta, key("block_count"), shapes, source)
    n_heads = header_int(meta, key("attention.head_count"), source)
    kv = header_int(meta, key("attention.head_count_kv"), source, default=n_heads)
    d_model = header_int(meta, key("embedding_length"), source)
    d_ff = header_int(meta, key("feed_forward_length"), source)
    vocab = vocab_rows(meta, arch, shapes, source)
    head_key = next((k for k in map(key, _HEAD_DIM_KEYS) if meta.get(k)), None)
    head_dim = None if head_key is None else header_int(meta, head_key, source)
    D = head_dim or d_model // n_heads
    width = f"{key('embedding_length')} = {d_model}"
    heads = f"heads of {D} ({head_key or f'{width} / heads'}) and {width}"
    for name, rows, why in (
        ("token_embd.weight", vocab, f"the vocabulary of {vocab} tokens and {width}"),
        ("blk.0.attn_q.weight", n_heads * D, f"{key('attention.head_count')} = {n_heads} {heads}"),
        ("blk.0.attn_k.weight", kv * D, f"{key('attention.head_count_kv')} = {kv} {heads}"),
        ("blk.0.ffn_up.weight", d_ff, f"{key('feed_forward_length')} = {d_ff} and {width}"),
    ):
        check_shape(shapes, name, (rows, d_model), why, source)
    common: dict[str, Any] = dict(
        family=arch,
        vocab_size=vocab,
        max_len=header_int(meta, key("context_length"), source),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=kv,
        d_ff=d_ff,
        norm_eps=header_float(meta, key("attention.layer_norm_rms_epsilon"), source),
        rope_base=header_float(meta, key("rope.freq_base"), source, default=10000.0),
        tie_embeddings="output.weight" not in shapes,
    )
    if head_dim is not None and head_dim != d_model // n_heads:
        common["head_dim"] = head_dim
    try:
        if arch == "gemma3":
            # llama.cpp: 1/√(C/H) for the 27B model (query_pre_attn_scalar = C/H), 1/√D else
            scalar = d_model / n_heads if n_layers == 62 else D
            return DecoderConfig(
                **common,
                activation="gelu_tanh",
                local_rope_base=GEMMA3_LOCAL_ROPE_BASE,
                sliding_window=header_int(meta, key("attention.sliding_window"), source),
                layer_kinds=gemma3_layer_kinds(n_layers, GEMMA3_PATTERN),
                qk_norm=True,
                sandwich_norm=True,
                embed_scale=True,
                attn_scale=scalar**-0.5,
            )
        bias = "blk.0.attn_q.bias" in shapes
        return DecoderConfig(**common, qkv_bias=bias, out_bias="blk.0.attn_output.bias" in shapes)
    except (TypeError, ValueError) as e:  # what the sizes above cannot be together
        raise ValueError(f"{source}: the GGUF header's sizes do not make a model: {e}") from None


def gguf_names(config: DecoderConfig) -> dict[str, str]:
    """GGUF tensor name → dikkat state-dict name, for every tensor the model takes."""
    names = {"token_embd.weight": "tok_emb.weight", "output_norm.weight": "norm_f.weight"}
    if not config.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    per_layer = {
        "attn_q": "attn.q_proj",
        "attn_k": "attn.k_proj",
        "attn_v": "attn.v_proj",
        "attn_output": "attn.out_proj",
        "ffn_gate": "mlp.gate",
        "ffn_up": "mlp.up",
        "ffn_down": "mlp.down",
        "attn_norm": "attn_norm",
        "ffn_norm": "mlp_norm",
    }
    if config.qk_norm:
        per_layer |= {"attn_q_norm": "attn.q_norm", "attn_k_norm": "attn.k_norm"}
    if config.sandwich_norm:
        per_layer |= {"post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_mlp_norm"}
    biases = [p for p, on in (("attn_q", config.qkv_bias), ("attn_k", config.qkv_bias),
              ("attn_v", config.qkv_bias), ("attn_output", config.out_bias)) if on]  # fmt: skip
    for i in range(config.n_layers):
        for theirs, ours in per_layer.items():
            names[f"blk.{i}.{theirs}.weight"] = f"blocks.{i}.{ours}.weight"
        for theirs in biases:
            names[f"blk.{i}.{theirs}.bias"] = f"blocks.{i}.{per_layer[theirs]}.bias"
    return names


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's reordering of a q or k projection's rows (``n_heads`` heads of D rows):
    within each head it interleaved the two halves, row pairs (j, D/2 + j) → (2j, 2j + 1)."""
    rows = w.shape[0]
    halves = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # (heads, D/2, 2, …)
    return halves.transpose(1, 2).reshape(w.shape)


def from_gguf(name: str, tensor: Tensor, config: DecoderConfig) -> Tensor:
    """A GGUF tensor in dikkat's layout (the Llama q/k rows put back, see the module doc)."""
    if config.family == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
        return unpermute_rope_rows(tensor, config.n_heads)
    if config.family == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
        return unpermute_rope_rows(tensor, config.kv_heads)
    return tensor


def config_from_hf(hf: dict[str, Any], source: str) -> DecoderConfig:
    """The config of the model an HF ``config.json`` (as a dict) describes."""
    model_type = hf.get("model_type")
    family = HF_MODEL_TYPES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        hint = " (a multimodal Gemma 3: dikkat runs its text model, gemma3_text)" * (
            model_type == "gemma3"
        )
        raise ValueError(
            f"{source}: model_type {model_type!r} is not one dikkat runs{hint}; it reads "
            f"{', '.join(HF_MODEL_TYPES)}"
        )
    _refuse_unsupported(hf, source)

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"{source}: config.json has no {key!r}")
        return hf[key]

    n_heads, d_model = int(need("num_attention_heads")), int(need("hidden_size"))
    n_layers = int(need("num_hidden_layers"))
    head_dim = hf.get("head_dim")
    bases = _rope_bases(hf)
    kinds = _layer_kinds(hf, family, n_layers)
    window = hf.get("sliding_window") if "sliding" in kinds else None
    common: dict[str, Any] = dict(
        family=family,
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
        sliding_window=None if window is None else int(window),
        layer_kinds=kinds if "sliding" in kinds else None,
        tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3")),
    )
    if family == "gemma3":
        return DecoderConfig(
            **common,
            activation="gelu_tanh",
            local_rope_base=bases.get("sliding_attention", GEMMA3_LOCAL_ROPE_BASE),
            qk_norm=True,
            sandwich_norm=True,
            embed_scale=True,
            attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        )
    bias = bool(hf.get("attention_bias", False))
    return DecoderConfig(
        **common,
        qkv_bias=bias or family == "qwen2",  # Qwen2 always has q/k/v biases, no output bias
        out_bias=bias,
    )


def _refuse_unsupported(hf: dict[str, Any], source: str) -> None:
    act = hf.get("hidden_act") or hf.get("hidden_activation")
    expected = "gelu_pytorch_tanh" if hf.get("model_type") == "gemma3_text" else "silu"
    if act not in (None, expected):
        raise ValueError(f"{source}: activation {act!r} is not implemented (expected {expected!r})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "rope_scaling"):
        if hf.get(key) is not None:
            raise ValueError(f"{source}: {key}={hf[key]!r} is not implemented in dikkat")
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=True is not implemented in dikkat")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=True is not implemented")


def _rope_bases(hf: dict[str, Any]) -> dict[str, float]:
    """RoPE base per layer kind ("full_attention", "sliding_attention") from either layout of
    transformers' config: ``rope_parameters`` (transformers 5, per kind for Gemma 3) or the older
    ``rope_theta`` / ``rope_local_base_freq``."""
    params = hf.get("rope_parameters")
    if params is None:
        bases = {"full_attention": float(hf.get("rope_theta", 10000.0))}
        if "rope_local_base_freq" in hf:
            bases["sliding_attention"] = float(hf["rope_local_base_freq"])
        return bases
    per_kind = params if "rope_theta" not in params else {"full_attention": params}
    bases = {}
    for kind, p in per_kind.items():
        if p.get("rope_type", "default") != "default":
            raise ValueError(f"RoPE type {p['rope_type']!r} ({kind}) is not implemented in dikkat")
        bases[kind] = float(p["rope_theta"])
    return bases


def _layer_kinds(hf: dict[str, Any], family: str, n_layers: int) -> tuple[LayerKind, ...]:
    """Each layer's kind: ``layer_types`` where the config lists them, else the family's rule."""
    types = hf.get("layer_types")
    if types is not None:
        named = {"full_attention": "full", "sliding_attention": "sliding"}
        unknown = sorted(set(types) - set(named))
        if unknown or len(types) != n_layers:
            raise ValueError(f"layer_types {types} is not one kind per layer of {named}")
        return tuple(named[t] for t in types)  # type: ignore[misc]
    if family == "gemma3":
        return gemma3_layer_kinds(n_layers, int(hf.get("sliding_window_pattern", GEMMA3_PATTERN)))
    windowed = hf.get("sliding_window") is not None and (
        family == "mistral" or (family == "qwen2" and hf.get("use_sliding_window"))
    )
    if family == "qwen2" and windowed:  # Qwen2: sliding from layer max_window_layers on
        start = int(hf.get("max_window_layers", n_layers))
        return tuple("sliding" if i >= start else "full" for i in range(n_layers))
    return ("sliding" if windowed else "full",) * n_layers


def hf_names(config: DecoderConfig) -> dict[str, str]:
    """HF state-dict name → dikkat's, for every tensor the model takes."""
    names = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "norm_f.weight"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    per_layer = {
        "self_attn.q_proj": "attn.q_proj",
        "self_attn.k_proj": "attn.k_proj",
        "self_attn.v_proj": "attn.v_proj",
        "self_attn.o_proj": "attn.out_proj",
        "mlp.gate_proj": "mlp.gate",
        "mlp.up_proj": "mlp.up",
        "mlp.down_proj": "mlp.down",
        "input_layernorm": "attn_norm",
    }
    if config.sandwich_norm:  # Gemma: "post_attention" is after attention, before the residual
        per_layer |= {
            "post_attention_layernorm": "post_attn_norm",
            "pre_feedforward_layernorm": "mlp_norm",
            "post_feedforward_layernorm": "post_mlp_norm",
        }
    else:  # Llama: "post_attention" is the norm before the MLP
        per_layer["post_attention_layernorm"] = "mlp_norm"
    if config.qk_norm:
        per_layer |= {"self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
    for i in range(config.n_layers):
        for theirs, ours in per_layer.items():
            names[f"model.layers.{i}.{theirs}.weight"] = f"blocks.{i}.{ours}.weight"
        for proj, on in (("q", config.qkv_bias), ("k", config.qkv_bias), ("v", config.qkv_bias),
                         ("o", config.out_bias)):  # fmt: skip
            if on:
                ours = per_layer[f"self_attn.{proj}_proj"]
                names[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = f"blocks.{i}.{ours}.bias"
    return names


def from_hf(name: str, tensor: Tensor, config: DecoderConfig) -> Tensor:
    """An HF tensor in dikkat's layout: Gemma's norm scales w become 1 + w (in fp32)."""
    if config.family == "gemma3" and "norm" in name.rsplit(".", 2)[-2]:
        return 1.0 + tensor.to(torch.float32)
    return tensor
