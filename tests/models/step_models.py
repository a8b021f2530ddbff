"""Small models of each decoder family the decode steps serve (tests/models/test_static_step.py,
tests/models/test_aot_step.py): grouped query heads (llama), sliding windows and query/key
norms (gemma3), learned positions (gpt2), RoPE in a GPT (gpt-rope)."""

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
