"""Weights from the systems people trust: PyTorch's MHA, Hugging Face GPT-2 and BERT, MiniLM."""

from dikkat.interop.hf_gpt2 import gpt2_config, gpt_from_hf

__all__ = ["gpt2_config", "gpt_from_hf"]
