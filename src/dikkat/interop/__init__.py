"""Weights from the systems people trust: PyTorch's MHA, Hugging Face GPT-2 and BERT, MiniLM."""

from dikkat.interop.hf_bert import bert_config, bert_from_hf
from dikkat.interop.hf_gpt2 import gpt2_config, gpt_from_hf, load_hf_gpt2_dir

__all__ = ["bert_config", "bert_from_hf", "gpt2_config", "gpt_from_hf", "load_hf_gpt2_dir"]
