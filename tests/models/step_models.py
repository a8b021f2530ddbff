"""Small models of each decoder family the decode steps serve (tests/models/test_static_step.py,
tests/models/test_aot_step.py): grouped query heads (llama), sliding windows and query/key
norms (gemma3), soft-capping (gemma2), norms after the parts only, a layer without RoPE and
scaled RoPE (olmo2), experts (qwen3moe), learned positions (gpt2), RoPE in a GPT (gpt-rope)."""

from __future__ import annotations

import torch

from dikkat.models import GPT, Decoder, DecoderConfig, GPTConfig
from dikkat.models.io import meta_modules

CONFIGS = {
    "llama": DecoderConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2),
    "gemma3": DecoderConfig.preset(
        "gemma3-270m", vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48,
        n_layers=3, sliding_window=4, layer_kinds=("sliding", "full", "sliding"), max_len=64,
    ),
    # soft-capped scores and logits (caps that bite on random weights), every other layer sliding
    "gemma2": DecoderConfig.preset(
        "gemma3-270m", vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48,
        n_layers=2, sliding_window=4, layer_kinds=("sliding", "full"), max_len=64,
        qk_norm=False, attn_softcap=0.02, final_softcap=0.5,
    ),
    # OLMo 2's blocks (norms after, q/k norms over the width), a SmolLM3 layer without RoPE, and
    # scaled RoPE frequencies
    "olmo2": DecoderConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                           qk_norm=True, qk_norm_scope="width", pre_norm=False,
                           sandwich_norm=True, nope_layers=(1,), rope_factors=(1.0, 2.0, 4.0, 8.0)),
    # a sparse mixture of experts in each block (Qwen3-MoE), run by an opaque op when traced
    "qwen3moe": DecoderConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                              d_ff=16, n_experts=4, experts_per_token=2, qk_norm=True),
    "gpt2": GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_len=64),
    "gpt-rope": GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                          position="rope", max_len=64),
}  # fmt: skip


def build(family: str, seed: int | None = None) -> Decoder | GPT:
    """The family's model in eval mode, its weights drawn after ``torch.manual_seed(seed)``
    (None: from the generator as it is)."""
    if seed is not None:
        torch.manual_seed(seed)
    config = CONFIGS[family]
    return (GPT if isinstance(config, GPTConfig) else Decoder)(config).eval()


def build_half(
    family: str, seed: int | None = None, dtype: torch.dtype = torch.float16
) -> Decoder | GPT:
    """The family's model with its matrices held in ``dtype`` (fp16 or bf16), as a loader holds a
    GGUF file's F16 or BF16 ones (dikkat.weights.half)."""
    model = build(family, seed)
    weights = {k: v.to(dtype) if v.dim() == 2 else v for k, v in model.state_dict().items()}
    with meta_modules():
        held = type(model)(model.config)
    held.hold(weights, f"{family} in {dtype}")
    return held.eval()
