"""GPT: a decoder-only, causal stack of pre-norm blocks (docs/contract.md §11).

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``V`` vocabulary.

ids (B, T) → token embedding (+ learned positions, or RoPE inside attention) → n blocks, each
attending only to the past → final LayerNorm → logits (B, T, V) through the output embedding,
which by default is the token embedding itself (tied).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from dikkat.core.masks import Mask
from dikkat.generation.protocol import CacheLayout
from dikkat.layers.block import Block, BlockConfig
from dikkat.layers.inputs import check_token_ids
from dikkat.layers.linear import Linear
from dikkat.layers.loss import Scratch, linear_cross_entropy
from dikkat.layers.mlp import Activation
from dikkat.layers.norm import LayerNorm
from dikkat.layers.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
)
from dikkat.models.generating import Generates
from dikkat.models.init import init_normal_
from dikkat.models.io import SaveLoad
from dikkat.presets import pick_preset
from dikkat.validate import check_bool, check_choice, check_float, check_sizes


@dataclass(frozen=True)
class GPTConfig:
    """Sizes and choices of a GPT."""

    vocab_size: int = 256  # V: 256 = raw bytes
    max_len: int = 256  # longest sequence (context length)
    d_model: int = 128  # width C
    n_layers: int = 4  # number of blocks
    n_heads: int = 4  # query heads H
    n_kv_heads: int | None = None  # key/value heads G (GQA); None = n_heads
    d_ff: int | None = None  # MLP hidden width; None = 4·d_model
    position: Literal["learned", "rope"] = "learned"  # added vectors, or rotated q/k
    rope_base: float = 10000.0  # RoPE frequency base
    dropout: float = 0.0  # on embeddings, residual branches and attention weights
    bias: bool = True  # biases in projections and LayerNorms
    norm_eps: float = 1e-5  # LayerNorm epsilon
    activation: Activation = "gelu_tanh"  # GPT-2's GELU
    tie_embeddings: bool = True  # output projection = token embedding

    def __post_init__(self) -> None:
        check_sizes(self, "vocab_size", "max_len", "n_layers")
        check_choice("position", self.position, ("learned", "rope"))
        # base^(−2i/D): a base ≤ 0 (or NaN, inf) gives NaN frequencies, NaN in every score
        check_float("rope_base", self.rope_base, low=0.0, low_open=True)
        check_bool("tie_embeddings", self.tie_embeddings)
        block = self.block()  # validates widths, head counts, norm_eps, activation, dropout
        if self.position == "rope" and block.head_dim % 2:
            raise ValueError(
                f"position='rope' rotates pairs of features: head dim d_model / n_heads = "
                f"{block.head_dim} must be even"
            )

    def block(self) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            d_ff=self.d_ff,
            norm="pre",
            norm_eps=self.norm_eps,
            activation=self.activation,
            bias=self.bias,
            dropout=self.dropout,
        )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A named configuration, optionally with some fields changed."""
        return pick_preset(GPT_PRESETS, name, "GPT", overrides)


GPT_PRESETS: dict[str, GPTConfig] = {
    # For tests and the demo: bytes in, 4 layers of width 128.
    "tiny": GPTConfig(),
    # GPT-2 small (124M): 12 layers, 12 heads, width 768, BPE vocabulary, context 1024.
    "gpt2-small": GPTConfig(vocab_size=50257, max_len=1024, d_model=768, n_layers=12, n_heads=12),
}


class GPT(Generates, SaveLoad, nn.Module):
    """Decoder-only Transformer language model.

    >>> model = GPT(GPTConfig.preset("tiny"))
    >>> model(torch.randint(0, 256, (2, 16))).shape
    torch.Size([2, 16, 256])
    """

    config_class = GPTConfig

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        self._loss_scratch = Scratch()  # the training loss's large temporaries, between steps
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = (
            LearnedPositionalEmbedding(c.max_len, c.d_model) if c.position == "learned" else None
        )
        rope = (
            RotaryEmbedding(c.d_model // c.n_heads, base=c.rope_base, max_len=c.max_len)
            if c.position == "rope"
            else None
        )
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c.block(), rope=rope) for _ in range(c.n_layers))
        self._ropes = () if rope is None else (rope,)  # shared by the blocks
        self.norm_f = LayerNorm(c.d_model, eps=c.norm_eps, bias=c.bias)
        self.lm_head = Linear(c.d_model, c.vocab_size, bias=False)
        self.apply(init_normal_)
        # GPT-2: scale the projections that write into the residual stream by 1/√(2·layers).
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layers))
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def cache_layout(self) -> CacheLayout:
        c = self.config
        w = self.tok_emb.weight
        kv_heads, head_dim = c.block().kv_heads, c.d_model // c.n_heads
        return CacheLayout(c.n_layers, kv_heads, head_dim, c.max_len, w.dtype, w.device)

    def embed(self, ids: Tensor, offset: int, positions: Tensor) -> Tensor:
        """ids (B, T) → (B, T, C): token embeddings, plus learned positions' where the model
        has them (dropped out in training)."""
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            x = self.pos_emb(x, offset, positions)
        if self.training and self.drop.p > 0:  # the identity otherwise: one call less per token
            x = self.drop(x)
        return x

    def loss(
        self,
        ids: Tensor,
        targets: Tensor,
        mask: Mask | Tensor | None = None,
        *,
        valid: Tensor | None = None,
    ) -> Tensor:
        """Mean next-token cross-entropy of ``targets`` (B, T) given ``ids`` (B, T), in nats.

        Equal to ``cross_entropy(self(ids, mask, valid=valid), targets)`` (targets of −100 are
        skipped), but the (B, T, V) logits are never held: see
        :func:`dikkat.layers.linear_cross_entropy`. ``valid`` hides padding from attention, as
        in :meth:`forward`; the loss of a pad is skipped only where its target is −100.
        """
        # kinds and shapes before the forward; the forward checks the ids' range, the loss the
        # targets' (so that each is read once)
        check_token_ids("ids", ids, None)
        check_token_ids("targets", targets, None)
        if targets.shape != ids.shape:
            raise ValueError(
                f"targets must have the shape of ids {tuple(ids.shape)}, got {tuple(targets.shape)}"
            )
        hidden = self(ids, mask, valid=valid, return_hidden=True)  # (B, T, C)
        return linear_cross_entropy(
            hidden, self.lm_head.weight, targets, scratch=self._loss_scratch
        )
