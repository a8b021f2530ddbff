"""Transformer layers: parameters live here; the math they call lives in :mod:`dikkat.core`."""

from dikkat.layers.attention import MultiHeadAttention
from dikkat.layers.block import PRESETS, Block, BlockConfig, BlockWeights
from dikkat.layers.inference import InferenceLinear, inference_model, onednn_linear_available
from dikkat.layers.kv_cache import KVCache, SelfAttentionCache
from dikkat.layers.linear import Linear, LinearRows
from dikkat.layers.loss import Scratch, linear_cross_entropy
from dikkat.layers.mlp import MLP, GatedMLP
from dikkat.layers.norm import LayerNorm, RMSNorm
from dikkat.layers.packed import PackedWeight, packed_linear
from dikkat.layers.packed_layers import PackedEmbedding, PackedLinear
from dikkat.layers.packed_quantize import quantize_q4, quantize_q8
from dikkat.layers.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_slopes,
)
from dikkat.layers.quantized import (
    WEIGHT_FORMATS,
    Int8Weight,
    W8A8Weight,
    WeightFormat,
    dequantize_int8,
    int8_linear,
    quantize_int8,
    quantize_w8a8,
    w8a8_available,
    w8a8_linear,
)

__all__ = [
    "MLP",
    "PRESETS",
    "WEIGHT_FORMATS",
    "ALiBi",
    "Block",
    "BlockConfig",
    "BlockWeights",
    "GatedMLP",
    "InferenceLinear",
    "Int8Weight",
    "KVCache",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "Linear",
    "LinearRows",
    "MultiHeadAttention",
    "PackedEmbedding",
    "PackedLinear",
    "PackedWeight",
    "RMSNorm",
    "RotaryEmbedding",
    "Scratch",
    "SelfAttentionCache",
    "SinusoidalPositionalEncoding",
    "W8A8Weight",
    "WeightFormat",
    "alibi_slopes",
    "dequantize_int8",
    "inference_model",
    "int8_linear",
    "linear_cross_entropy",
    "onednn_linear_available",
    "packed_linear",
    "quantize_int8",
    "quantize_q4",
    "quantize_q8",
    "quantize_w8a8",
    "w8a8_available",
    "w8a8_linear",
]
