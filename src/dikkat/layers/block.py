"""The Transformer block: attention and an MLP, each wrapped in a residual and a LayerNorm
(docs/contract.md §10).

Notation: ``B`` batch, ``T`` length, ``S`` context length, ``C`` model width.

Pre-norm (GPT-2 and most models since)::

    x ← x + Attention(LN(x))
    x ← x + CrossAttention(LN(x), context)     # decoder blocks of an encoder-decoder only
    x ← x + MLP(LN(x))

Post-norm (the original 2017 Transformer, BERT)::

    x ← LN(x + Attention(x))
    x ← LN(x + CrossAttention(x, context))
    x ← LN(x + MLP(x))

The residual path adds ∂L/∂x_out to ∂L/∂x_in, so the gradient reaches deep layers by a sum, not
only through a product of layer Jacobians.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from dikkat.core.masks import Mask
from dikkat.layers.attention import MultiHeadAttention
from dikkat.layers.inputs import check_meets
from dikkat.layers.kv_cache import KVCache, SelfAttentionCache
from dikkat.layers.mlp import ACTIVATIONS, MLP, Activation
from dikkat.layers.norm import LayerNorm
from dikkat.layers.positional import ALiBi, RotaryEmbedding
from dikkat.presets import pick_preset
from dikkat.validate import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_probability,
    check_sizes,
)


@dataclass(frozen=True)
class BlockConfig:
    """Sizes and choices of one Transformer block."""

    d_model: int = 512  # width C of the residual stream
    n_heads: int = 8  # query heads H; head dim D = C / H
    n_kv_heads: int | None = None  # key/value heads G (GQA); None = n_heads
    d_ff: int | None = None  # MLP hidden width; None = 4·d_model
    norm: Literal["pre", "post"] = "pre"  # where LayerNorm sits relative to the residual
    norm_eps: float = 1e-5  # LayerNorm epsilon (BERT uses 1e-12)
    activation: Activation = "gelu"  # MLP nonlinearity: gelu (exact), gelu_tanh, relu
    bias: bool = True  # biases in projections and LayerNorm
    dropout: float = 0.0  # dropout on residual branches and attention weights in training
    cross_attention: bool = False  # add a cross-attention sub-layer (encoder-decoder decoder)

    def __post_init__(self) -> None:
        check_sizes(self, "d_model", "n_heads")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        check_int("n_kv_heads", self.n_kv_heads, at_least=None, optional=True)  # range: below
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ValueError(f"n_kv_heads={kv} must be positive and divide n_heads={self.n_heads}")
        check_int("d_ff", self.d_ff, optional=True)
        check_choice("norm", self.norm, ("pre", "post"))
        # eps ≤ 0: a constant row divides 0 by 0, a negative eps takes √ of a negative: NaN
        check_float("norm_eps", self.norm_eps, low=0.0, low_open=True)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_bool("bias", self.bias)
        check_probability("dropout", self.dropout)
        check_bool("cross_attention", self.cross_attention)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @classmethod
    def preset(cls, name: str, **overrides: object) -> BlockConfig:
        """A named configuration, optionally with some fields changed."""
        return pick_preset(PRESETS, name, "block", overrides)


PRESETS: dict[str, BlockConfig] = {
    # "Attention Is All You Need", base model: d 512, 8 heads of 64, MLP 2048, ReLU, post-norm,
    # dropout 0.1.
    "original-base": BlockConfig(
        d_model=512, n_heads=8, d_ff=2048, norm="post", activation="relu", dropout=0.1
    ),
    # The same paper's big model.
    "original-big": BlockConfig(
        d_model=1024, n_heads=16, d_ff=4096, norm="post", activation="relu", dropout=0.3
    ),
    # GPT-2 small: pre-norm, tanh GELU, 12 heads of 64.
    "gpt2-small": BlockConfig(d_model=768, n_heads=12, activation="gelu_tanh"),
    # BERT-base: post-norm, exact GELU, eps 1e-12.
    "bert-base": BlockConfig(d_model=768, n_heads=12, norm="post", norm_eps=1e-12),
}


@dataclass
class BlockWeights:
    """Attention weights of one block: self-attention (B, H, T, T), cross (B, H, T, S) or None."""

    self_attn: Tensor
    cross_attn: Tensor | None = None


class Block(nn.Module):
    """One Transformer block; position modules (RoPE, ALiBi) are injected and shared by blocks.

    >>> import torch
    >>> from dikkat import masks
    >>> block = Block(BlockConfig(d_model=32, n_heads=4))
    >>> block(torch.randn(2, 7, 32), masks.causal()).shape
    torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        config: BlockConfig,
        *,
        rope: RotaryEmbedding | None = None,
        alibi: ALiBi | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(config, BlockConfig):
            raise TypeError(f"config must be a BlockConfig, got {type(config).__name__}")
        c = config
        self.config = c
        self.attn = MultiHeadAttention(
            c.d_model,
            c.n_heads,
            n_kv_heads=c.n_kv_heads,
            bias=c.bias,
            dropout=c.dropout,
            rope=rope,
            alibi=alibi,
            backend=backend,
        )
        self.norm1 = LayerNorm(c.d_model, eps=c.norm_eps, bias=c.bias)
        self.cross_attn = None
        self.norm_cross = None
        if c.cross_attention:
            self.cross_attn = MultiHeadAttention(
                c.d_model,
                c.n_heads,
                n_kv_heads=c.n_kv_heads,
                bias=c.bias,
                dropout=c.dropout,
                backend=backend,
            )
            self.norm_cross = LayerNorm(c.d_model, eps=c.norm_eps, bias=c.bias)
        self.mlp = MLP(c.d_model, c.hidden, activation=c.activation, bias=c.bias)
        self.norm2 = LayerNorm(c.d_model, eps=c.norm_eps, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)

    def _residual(self, x: Tensor, norm: LayerNorm, sublayer) -> tuple[Tensor, Tensor | None]:
        """Apply one sub-layer with its residual and norm; the sub-layer returns (y, weights)."""
        if self.config.norm == "pre":
            y, w = sublayer(norm(x))
            return x + self._dropout(y), w
        y, w = sublayer(x)
        return norm(x + self._dropout(y)), w

    def _dropout(self, y: Tensor) -> Tensor:
        # the identity in evaluation: skipping the call saves a module call per sub-layer in
        # every decoding step
        return self.drop(y) if self.training and self.drop.p > 0 else y

    def forward(
        self,
        x: Tensor,
        mask: Mask | Tensor | None = None,
        *,
        context: Tensor | None = None,
        context_mask: Mask | Tensor | None = None,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: KVCache | SelfAttentionCache | None = None,
        cross_cache: KVCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, BlockWeights]:
        """x (B, T, C) → (B, T, C).

        Args:
            mask: self-attention mask over (B, H, T, T), True = may attend.
            context: encoder output (B, S, C), required when the block has cross-attention.
            context_mask: cross-attention mask over (B, H, T, S), e.g. source padding.
            offset, positions: cache slot / absolute positions of x's tokens (RoPE, ALiBi).
            cache, cross_cache: KV caches of the self- and cross-attention (generation).
            return_weights: also return a :class:`BlockWeights`.
        """
        check_meets("x", x, self.norm1.weight, "Block")
        if (context is None) == (self.cross_attn is not None):
            if self.cross_attn is not None:
                raise ValueError("this block has cross-attention and needs a context")
            raise ValueError("this block has no cross-attention and takes no context")

        def self_attention(h: Tensor) -> tuple[Tensor, Tensor | None]:
            return self._attend(self.attn, h, None, mask, offset, positions, cache, return_weights)

        x, w_self = self._residual(x, self.norm1, self_attention)
        w_cross = None
        if self.cross_attn is not None:

            def cross_attention(h: Tensor) -> tuple[Tensor, Tensor | None]:
                return self._attend(
                    self.cross_attn, h, context, context_mask, 0, None, cross_cache, return_weights
                )

            x, w_cross = self._residual(x, self.norm_cross, cross_attention)
        x, _ = self._residual(x, self.norm2, lambda h: (self.mlp(h), None))
        return (x, BlockWeights(w_self, w_cross)) if return_weights else x

    def attention_input(self, x: Tensor) -> Tensor:
        """What the self-attention reads of x: ``norm1(x)`` in a pre-norm block, x in a
        post-norm one."""
        return self.norm1(x) if self.config.norm == "pre" else x

    def after_attention(self, x: Tensor, a: Tensor) -> Tensor:
        """The rest of a block without cross-attention once its self-attention gave ``a`` for
        :meth:`attention_input` of x: the residuals, norms and MLP (a static decode step
        computes the attention its own way, then calls this)."""
        if self.cross_attn is not None:
            raise ValueError("after_attention serves blocks without cross-attention")
        x = x + self._dropout(a)
        if self.config.norm == "post":
            x = self.norm1(x)
        x, _ = self._residual(x, self.norm2, lambda h: (self.mlp(h), None))
        return x

    @staticmethod
    def _attend(
        layer: MultiHeadAttention,
        h: Tensor,
        context: Tensor | None,
        mask: Mask | Tensor | None,
        offset: int,
        positions: Tensor | None,
        cache: KVCache | SelfAttentionCache | None,
        return_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        out = layer(
            h,
            context,
            mask,
            offset=offset,
            positions=positions,
            cache=cache,
            return_weights=return_weights,
        )
        return out if return_weights else (out, None)
