"""Tiny randomly initialised Hugging Face decoders of each family dikkat loads, saved as folders
(config.json, model.safetensors, a byte-level tokenizer.json): the reference for the HF-folder
path of ``dikkat.pretrained.load``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# The sizes every family shares: 2 kv heads under 4 query heads, 3 layers, and a 6-key window on
# the sliding layers, so that a 20-token text is longer than the window.
COMMON = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=0,  # the tokenizer's <s> and </s>
    eos_token_id=1,
    pad_token_id=None,
)
WINDOW = 6
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500.0,
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def hf_config(family: str):
    """transformers' config of a tiny model of ``family`` (llama, llama3 — Llama with Llama 3.1's
    RoPE scaling —, mistral, qwen2, qwen3, qwen3moe, smollm3, olmo2, phi3, phi4 — Phi-3 with
    Phi-4-mini's RoPE —, gemma2, gemma3)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    if family == "llama":
        return LlamaConfig(**COMMON, rope_theta=500.0, tie_word_embeddings=False)
    if family == "llama3":  # Llama 3.1's RoPE scaling: of the 4 frequencies (heads of 8), with
        # wavelengths 6.3, 30, 140 and 660 against 32 / 4 and 32 / 1: one kept, one blended, two
        # divided
        return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False)
    if family == "qwen2":  # sliding from layer 1 on
        return Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
    if family == "qwen3":  # heads of 16, not 32 / 4; q/k norms
        return Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)
    if family == "qwen3moe":  # 4 experts of 16, 2 a token; Qwen 3's attention
        return Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=True,
                              tie_word_embeddings=False)  # fmt: skip
    if family == "smollm3":  # 4 layers: the last has no RoPE, as llama.cpp's step of 4 says
        return SmolLM3Config(**(COMMON | {"num_hidden_layers": 4}), tie_word_embeddings=True)
    if family == "olmo2":  # norms after attention and MLP only; q/k norms over the width
        return Olmo2Config(**COMMON, tie_word_embeddings=False)
    if family == "phi3":  # q/k/v and gate/up stored fused; every layer sliding
        return Phi3Config(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False)
    if family == "phi4":  # Phi-4-mini's RoPE: on half of each head (4 of 8 features), LongRoPE
        # past 20 positions (cos and sin times √(1 + ln 6.4 / ln 20)), no window: a 24-token text
        # turns by the long divisors, a 17-token generation by the short ones
        longrope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.5],
                        long_factor=[2.0, 7.0])  # fmt: skip
        return Phi3Config(
            **COMMON,
            tie_word_embeddings=True,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=20,
            rope_parameters=longrope,
        )
    if family == "gemma2":  # caps small enough to bite on random weights' scores and logits
        return Gemma2Config(
            **COMMON,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=0.3,
            final_logit_softcapping=0.5,
        )
    if family == "gemma3":  # head dim 16 ≠ 32 / 4, the 6-layer pattern cut to 3: all sliding
        config = Gemma3TextConfig(
            **COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16
        )
        config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        return config
    raise ValueError(family)


def save_tiny(family: str, folder: Path, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Build, randomise (norm scales and biases too) and save a tiny model, its config's
    ``overrides`` set; returns it (fp32, eval mode, eager attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # initialisers leave norms at 1 (or 0) and biases at 0: vary them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    model.eval().save_pretrained(folder)
    save_tokenizer(folder, COMMON["vocab_size"])
    return model


def save_tokenizer(folder: Path, vocab_size: int, merges: bool = False) -> None:
    """A byte-level BPE: 256 byte tokens and <s>, </s>, with ``merges`` a few merges too (" the",
    "in", "er"), as llama.cpp reads no BPE vocabulary without them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1} | {ch: i + 2 for i, ch in enumerate(sorted(alphabet))}
    pairs = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r")] if merges else []
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(pairs)}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
