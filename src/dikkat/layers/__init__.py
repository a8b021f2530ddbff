"""Transformer layers: parameters live here; the math they call lives in :mod:`dikkat.core`.

The layers that hold a weight in an inference format (bf16, int8, packed blocks) are
:mod:`dikkat.weights`."""

from dikkat.layers.attention import MultiHeadAttention
from dikkat.layers.block import PRESETS, Block, BlockConfig, BlockWeights
from dikkat.layers.kv_cache import KVCache, SelfAttentionCache
from dikkat.layers.linear import Linear, LinearRows
from dikkat.layers.loss import Scratch, linear_cross_entropy
from dikkat.layers.mlp import MLP, GatedMLP
from dikkat.layers.moe import SparseMoE
from dikkat.layers.norm import LayerNorm, RMSNorm
from dikkat.layers.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_slopes,
    llama3_rope_factors,
)

__all__ = [
    "MLP",
    "PRESETS",
    "ALiBi",
    "Block",
    "BlockConfig",
    "BlockWeights",
    "GatedMLP",
    "KVCache",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "Linear",
    "LinearRows",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "Scratch",
    "SelfAttentionCache",
    "SinusoidalPositionalEncoding",
    "SparseMoE",
    "alibi_slopes",
    "linear_cross_entropy",
    "llama3_rope_factors",
]
