"""dikkat — attention and the Transformer, end to end.

>>> import torch, dikkat
>>> q = k = v = torch.randn(1, 8, 16, 64)                      # (B, H, T, D)
>>> out = dikkat.attention(q, k, v, dikkat.masks.causal())      # True = may attend
"""

from dikkat import masks
from dikkat.core import (
    attention,
    available_backends,
    explain,
    reference_attention,
    register_backend,
)
from dikkat.layers import (
    MLP,
    ALiBi,
    Block,
    BlockConfig,
    LayerNorm,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)

__version__ = "0.1.0"

__all__ = [
    "MLP",
    "ALiBi",
    "Block",
    "BlockConfig",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "__version__",
    "attention",
    "available_backends",
    "explain",
    "masks",
    "reference_attention",
    "register_backend",
]
