"""Models: GPT (decoder-only), BERT (masked LM), Seq2Seq (the original translator), and Decoder
(the Llama family and Gemma 3, for pretrained weights: :mod:`dikkat.pretrained`)."""

from dikkat.models.aot_step import AotPoolStep, AotStep
from dikkat.models.bert import BERT, BERT_PRESETS, BERTConfig
from dikkat.models.decoder import DECODER_PRESETS, Decoder, DecoderBlock, DecoderConfig
from dikkat.models.gpt import GPT, GPT_PRESETS, GPTConfig
from dikkat.models.seq2seq import SEQ2SEQ_PRESETS, Seq2Seq, Seq2SeqConfig
from dikkat.models.static_step import StaticStep

__all__ = [
    "BERT",
    "BERT_PRESETS",
    "DECODER_PRESETS",
    "GPT",
    "GPT_PRESETS",
    "SEQ2SEQ_PRESETS",
    "AotPoolStep",
    "AotStep",
    "BERTConfig",
    "Decoder",
    "DecoderBlock",
    "DecoderConfig",
    "GPTConfig",
    "Seq2Seq",
    "Seq2SeqConfig",
    "StaticStep",
]
