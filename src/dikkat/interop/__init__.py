"""Weights from the systems people trust: PyTorch's MHA, Hugging Face GPT-2 and BERT, MiniLM;
and a GPT written out as a GPT-2 GGUF file that llama.cpp runs (``write_gguf``)."""

from dikkat.interop.gguf_gpt import write_gguf
from dikkat.interop.gguf_lora import write_lora_gguf, write_merged_gguf
from dikkat.interop.hf_bert import bert_config, bert_from_hf
from dikkat.interop.hf_gpt2 import gpt2_config, gpt_from_hf, load_hf_gpt2_dir

__all__ = [
    "bert_config",
    "bert_from_hf",
    "gpt2_config",
    "gpt_from_hf",
    "load_hf_gpt2_dir",
    "write_gguf",
    "write_lora_gguf",
    "write_merged_gguf",
]
