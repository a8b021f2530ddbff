"""BERT: a bidirectional, post-norm encoder with a masked-language-model head (docs/contract.md
§11).

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``V`` vocabulary.

Every token attends to every other real token (no causal mask): the model fills in hidden tokens
from both sides, which makes it an encoder, not a chat generator. Embeddings are the sum of token,
learned position and token-type (segment) vectors, then a LayerNorm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dikkat.core.masks import padding
from dikkat.layers.block import Block, BlockConfig
from dikkat.layers.inputs import check_token_ids, check_valid
from dikkat.layers.linear import Linear
from dikkat.layers.mlp import Activation
from dikkat.layers.norm import LayerNorm
from dikkat.layers.positional import LearnedPositionalEmbedding
from dikkat.models.init import init_normal_
from dikkat.models.io import SaveLoad
from dikkat.presets import pick_preset
from dikkat.validate import check_bool, check_sizes


@dataclass(frozen=True)
class BERTConfig:
    """Sizes and choices of a BERT encoder."""

    vocab_size: int = 256  # V
    max_len: int = 256  # longest sequence
    d_model: int = 128  # width C
    n_layers: int = 4  # blocks
    n_heads: int = 4  # heads H
    d_ff: int | None = None  # MLP hidden width; None = 4·d_model
    type_vocab_size: int = 2  # segment ids (sentence A / B)
    dropout: float = 0.0  # embeddings, residual branches, attention weights
    norm_eps: float = 1e-12  # BERT's LayerNorm epsilon
    activation: Activation = "gelu"  # exact GELU
    mlm_head: bool = True  # include the masked-LM head

    def __post_init__(self) -> None:
        check_sizes(self, "vocab_size", "max_len", "n_layers", "type_vocab_size")
        check_bool("mlm_head", self.mlm_head)
        self.block()  # validates widths, heads, norm_eps, activation, dropout

    def block(self) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            norm="post",
            norm_eps=self.norm_eps,
            activation=self.activation,
            dropout=self.dropout,
        )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> BERTConfig:
        """A named configuration, optionally with some fields changed."""
        return pick_preset(BERT_PRESETS, name, "BERT", overrides)


BERT_PRESETS: dict[str, BERTConfig] = {
    "tiny": BERTConfig(),
    "bert-base": BERTConfig(
        vocab_size=30522, max_len=512, d_model=768, n_layers=12, n_heads=12, dropout=0.1
    ),
    # all-MiniLM-L6-v2's encoder (no MLM head: it is a sentence encoder).
    "minilm-l6": BERTConfig(
        vocab_size=30522,
        max_len=512,
        d_model=384,
        n_layers=6,
        n_heads=12,
        d_ff=1536,
        mlm_head=False,
    ),
}


class MLMHead(nn.Module):
    """Hidden (B, T, C) → vocabulary logits (B, T, V): dense, GELU, LayerNorm, tied decoder."""

    def __init__(self, config: BERTConfig, embedding: nn.Embedding) -> None:
        super().__init__()
        self.dense = Linear(config.d_model, config.d_model)
        self.act = nn.GELU() if config.activation == "gelu" else nn.GELU(approximate="tanh")
        self.norm = LayerNorm(config.d_model, eps=config.norm_eps)
        self.embedding = embedding  # tied: logits = h · Eᵀ + bias
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(h))) @ self.embedding.weight.T + self.bias


class BERT(SaveLoad, nn.Module):
    """Bidirectional Transformer encoder with an optional masked-LM head.

    >>> model = BERT(BERTConfig.preset("tiny"))
    >>> model(torch.randint(0, 256, (2, 16))).shape           # MLM logits
    torch.Size([2, 16, 256])
    """

    config_class = BERTConfig

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = LearnedPositionalEmbedding(c.max_len, c.d_model)
        self.type_emb = nn.Embedding(c.type_vocab_size, c.d_model)
        self.emb_norm = LayerNorm(c.d_model, eps=c.norm_eps)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c.block()) for _ in range(c.n_layers))
        self.mlm = MLMHead(c, self.tok_emb) if c.mlm_head else None
        self.apply(init_normal_)

    def is_tied(self, name: str) -> bool:
        return name == "mlm.embedding.weight"

    def encode(
        self,
        ids: Tensor,
        valid: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """ids (B, T) → hidden states (B, T, C).

        Args:
            valid: (B, T) bool, False at padding (HF's ``attention_mask`` as bool); padding keys are
                hidden from every query.
            token_type_ids: (B, T) segment ids; default all 0.
            return_weights: also return each layer's weights (B, H, T, T).
        """
        c = self.config
        check_token_ids("ids", ids, c.vocab_size, device=self.tok_emb.weight.device)
        if ids.shape[1] > c.max_len:
            raise ValueError(f"ids has {ids.shape[1]} tokens, past max_len={c.max_len}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
        check_token_ids(
            "token_type_ids", token_type_ids, c.type_vocab_size, device=self.type_emb.weight.device
        )
        if token_type_ids.shape != ids.shape:
            raise ValueError(
                f"token_type_ids {tuple(token_type_ids.shape)} must match ids {tuple(ids.shape)}"
            )
        mask = None
        if valid is not None:
            check_valid("valid", valid, ids)
            mask = padding(valid=valid)
        x = self.pos_emb(self.tok_emb(ids)) + self.type_emb(token_type_ids)
        x = self.drop(self.emb_norm(x))
        weights = []
        for block in self.blocks:
            if return_weights:
                x, w = block(x, mask, return_weights=True)
                weights.append(w.self_attn)
            else:
                x = block(x, mask)
        return (x, weights) if return_weights else x

    def forward(
        self, ids: Tensor, valid: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Masked-LM logits (B, T, V)."""
        if self.mlm is None:
            raise ValueError("this BERT has no MLM head (mlm_head=False); use encode()")
        return self.mlm(self.encode(ids, valid, token_type_ids))
