"""Models: GPT (decoder-only), BERT (masked LM), Seq2Seq (the original translator)."""

from dikkat.models.gpt import GPT, GPT_PRESETS, GPTConfig

__all__ = ["GPT", "GPT_PRESETS", "GPTConfig"]
