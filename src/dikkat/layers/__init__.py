"""Transformer layers: parameters live here; the math they call lives in :mod:`dikkat.core`."""

from dikkat.layers.attention import MultiHeadAttention
from dikkat.layers.block import PRESETS, Block, BlockConfig, BlockWeights
from dikkat.layers.kv_cache import KVCache, SelfAttentionCache
from dikkat.layers.linear import (
    Linear,
    LinearRows,
    onednn_linear_available,
    packed_for_inference,
    release_packed,
)
from dikkat.layers.loss import Scratch, linear_cross_entropy
from dikkat.layers.mlp import MLP
from dikkat.layers.norm import LayerNorm
from dikkat.layers.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_slopes,
)

__all__ = [
    "MLP",
    "PRESETS",
    "ALiBi",
    "Block",
    "BlockConfig",
    "BlockWeights",
    "KVCache",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "Linear",
    "LinearRows",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "Scratch",
    "SelfAttentionCache",
    "SinusoidalPositionalEncoding",
    "alibi_slopes",
    "linear_cross_entropy",
    "onednn_linear_available",
    "packed_for_inference",
    "release_packed",
]
