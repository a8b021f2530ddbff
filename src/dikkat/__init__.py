"""dikkat — attention and the Transformer, end to end.

>>> import torch, dikkat
>>> q = k = v = torch.randn(1, 8, 16, 64)                      # (B, H, T, D)
>>> out = dikkat.attention(q, k, v, dikkat.masks.causal())      # True = may attend
"""

from dikkat import audit, distributed, hf, maps, masks, pretrained, serving
from dikkat.core import (
    AttentionAux,
    Capture,
    attention,
    attention_layers,
    attention_weights,
    available_backends,
    capture,
    clear_caches,
    explain,
    reference_attention,
    register_backend,
)
from dikkat.generation import (
    KVCache,
    LookupStats,
    SamplingParams,
    TokenLogprob,
    generate,
    inference_model,
    iter_generate,
    iter_lookup_generate,
    lookup_generate,
)
from dikkat.layers import (
    MLP,
    ALiBi,
    Block,
    BlockConfig,
    GatedMLP,
    LayerNorm,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RMSNorm,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)
from dikkat.models import (
    BERT,
    GPT,
    BERTConfig,
    Decoder,
    DecoderConfig,
    GPTConfig,
    Seq2Seq,
    Seq2SeqConfig,
)
from dikkat.tasks import TaskSpec
from dikkat.training.trainer import TrainConfig, Trainer, train
from dikkat.version import __version__

__all__ = [
    "BERT",
    "GPT",
    "MLP",
    "ALiBi",
    "AttentionAux",
    "BERTConfig",
    "Block",
    "BlockConfig",
    "Capture",
    "Decoder",
    "DecoderConfig",
    "GPTConfig",
    "GatedMLP",
    "KVCache",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "LookupStats",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SamplingParams",
    "Seq2Seq",
    "Seq2SeqConfig",
    "SinusoidalPositionalEncoding",
    "TaskSpec",
    "TokenLogprob",
    "TrainConfig",
    "Trainer",
    "__version__",
    "attention",
    "attention_layers",
    "attention_weights",
    "audit",
    "available_backends",
    "capture",
    "clear_caches",
    "distributed",
    "explain",
    "generate",
    "hf",
    "inference_model",
    "iter_generate",
    "iter_lookup_generate",
    "lookup_generate",
    "maps",
    "masks",
    "pretrained",
    "reference_attention",
    "register_backend",
    "serving",
    "train",
]
