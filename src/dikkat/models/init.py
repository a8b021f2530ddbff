"""Weight initialisation shared by the models."""

from __future__ import annotations

from torch import nn

from dikkat.layers.positional import LearnedPositionalEmbedding


def init_normal_(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 / BERT initialisation for ``model.apply``: N(0, std) matrices and embeddings, zero
    biases (LayerNorms keep their ones and zeros)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (nn.Embedding, LearnedPositionalEmbedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
