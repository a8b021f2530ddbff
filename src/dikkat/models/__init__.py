"""Models: GPT (decoder-only), BERT (masked LM), Seq2Seq (the original translator)."""

from dikkat.models.bert import BERT, BERT_PRESETS, BERTConfig
from dikkat.models.gpt import GPT, GPT_PRESETS, GPTConfig

__all__ = ["BERT", "BERT_PRESETS", "GPT", "GPT_PRESETS", "BERTConfig", "GPTConfig"]
