"""A tiny Hugging Face model of a Llama-shaped family written as a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` writes one: gguf-py's own name map for the architecture, the header
keys the converter writes, q/k rows interleaved for ``llama`` (GGML's adjacent-pair rope), F32
tensors, and a byte-level vocabulary padded as the converter pads one."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

INTERLEAVED = ("llama", "smollm3")  # the converter's LlamaModel and its subclasses
ONE_PLUS = ("gemma2", "gemma3")


def interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's q/k row order: each head's halves interleaved (GGML's adjacent pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _stored(state: dict) -> list[tuple[str, object]]:
    """The state dict as the converter names it: a mixture's fused experts (transformers'
    ``experts.gate_up_proj`` (E, 2H, C)) split into the gate and up stacks."""
    out = []
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out += [(f"{name[:-len('gate_up_proj')]}gate_proj.weight", gate),
                    (f"{name[:-len('gate_up_proj')]}up_proj.weight", up)]  # fmt: skip
        elif name.endswith("mlp.experts.down_proj"):
            out.append((f"{name}.weight", t))
        else:
            out.append((name, t))
    return out


def write_gguf(
    hf_model,
    path: Path,
    arch: str,
    *,
    rope_freqs: np.ndarray | None = None,
    chat_template: str | None = None,
    sizes: dict[str, int] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    kinds: dict[str, str] | None = None,
) -> Path:
    """A tiny HF model of a Llama-shaped family as a GGUF file of architecture ``arch``, F32
    tensors, a byte-level vocabulary; q/k rows interleaved where the converter interleaves them.
    ``sizes`` replaces or adds header sizes (under the architecture), ``extra`` adds tensors,
    ``kinds`` quantises the tensors whose GGUF name holds a key as its value says ("Q8_0")."""
    c = hf_model.config
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = dict(getattr(c, "rope_parameters", None) or {})
    rotated = int(D * rope.get("partial_rotary_factor", 1.0))  # the converter's rope_dims
    writer = gguf.GGUFWriter(path, arch)
    keys = {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "rope.dimension_count": rotated,
    }
    for key, value in (keys | (sizes or {})).items():
        writer.add_uint32(f"{arch}.{key}", value)
    if c.hidden_size // c.num_attention_heads != D or rotated != D:
        writer.add_uint32(f"{arch}.attention.key_length", D)
        writer.add_uint32(f"{arch}.attention.value_length", D)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's
        if getattr(c, key, None) is not None:
            writer.add_float32(f"{arch}.{key}", getattr(c, key))
    if rope.get("rope_type") == "longrope":  # the converter's Phi3MiniModel
        original = c.original_max_position_embeddings
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        scale = c.max_position_embeddings / original
        writer.add_float32(
            f"{arch}.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(original))
        )
        extra = {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                 "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32),
                 **(extra or {})}  # fmt: skip
    if getattr(c, "num_experts", None):  # the converter's Qwen2MoeModel and its subclasses
        writer.add_uint32(f"{arch}.expert_count", c.num_experts)
        writer.add_uint32(f"{arch}.expert_used_count", c.num_experts_per_tok)
        writer.add_uint32(f"{arch}.expert_feed_forward_length", c.moe_intermediate_size)
    if getattr(c, "sliding_window", None) is not None and arch in ("gemma2", "phi3"):
        writer.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    from tokenizers import pre_tokenizers

    tokens = ["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "ab"]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), c.vocab_size)]  # as the converter pads
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for name, t in _stored(hf_model.state_dict()):
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.float().numpy()
        if arch in INTERLEAVED and name.endswith("q_proj.weight"):
            data = interleaved(data, c.num_attention_heads)
        elif arch in INTERLEAVED and name.endswith("k_proj.weight"):
            data = interleaved(data, c.num_key_value_heads)
        elif arch in ONE_PLUS and name.endswith("norm.weight"):
            data = data + 1  # Gemma's norms scale by 1 + w: the converter stores 1 + w
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = next((k for part, k in (kinds or {}).items() if part in gguf_name), None)
        if kind is None:
            writer.add_tensor(gguf_name, data)
        else:
            kind_id = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind_id), raw_dtype=kind_id)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
