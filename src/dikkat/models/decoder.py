"""The decoders people run: Llama (SmolLM2 is one), Mistral, Qwen2, Qwen 3, SmolLM3, OLMo 2,
Gemma 2 and Gemma 3, as one stack whose differences are components chosen by a frozen config.

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``V`` vocabulary, ``D`` head dim.

ids (B, T) → token embedding (× √C for Gemma) → n blocks → RMSNorm → logits (B, T, V)::

    a = Attention(attn_norm(x), mask_i)      # RoPE on q and k; q/k RMSNorm first (Gemma 3)
    x = x + post_attn_norm(a)                # post-norm only in Gemma's "sandwich" blocks
                                             # (and OLMo 2's, which have no attn/mlp_norm)
    m = GatedMLP(mlp_norm(x))                # SwiGLU (Llama, Mistral, Qwen2) or GeGLU (Gemma);
                                             # a SparseMoE of them in Qwen3-MoE
    x = x + post_mlp_norm(m)

``mask_i`` is the causal mask, and on a *sliding* layer ``causal() & sliding_window(w)``: the
query sees its own key and the w − 1 before it (Mistral's window; five of every six layers of
Gemma 3, whose sliding layers also rotate by another RoPE base). The tiled backend skips the key
tiles such a mask hides, so a sliding layer costs O(T·w). What each family sets:

============  =========  ========  ==========  =======  ==============  ============
family        MLP        q/k bias  q/k norm    norms    sliding layers  embed scale
============  =========  ========  ==========  =======  ==============  ============
llama         SwiGLU     no        no          2        none            1
mistral       SwiGLU     no        no          2        all (if set)    1
qwen2         SwiGLU     yes       no          2        per config      1
qwen3         SwiGLU     no        RMSNorm     2        per config      1
qwen3moe      experts    no        RMSNorm     2        none            1
smollm3       SwiGLU     no        no          2        per config      1  (NoPE every 4th)
olmo2         SwiGLU     no        over width  2 after  none            1
gemma2        GeGLU      no        no          4        1 of every 2    √C (soft-capping)
gemma3        GeGLU      no        RMSNorm     4        5 of every 6    √C
============  =========  ========  ==========  =======  ==============  ============

References: Llama (Touvron et al. 2023, arXiv:2302.13971), Mistral 7B (arXiv:2310.06825), Gemma 3
(arXiv:2503.19786); transformers' ``modeling_llama.py`` and ``modeling_gemma3.py`` for the exact
order of operations, which the tests compare against.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dikkat.core.masks import Mask, as_mask, sliding_window
from dikkat.generation.protocol import CacheLayout
from dikkat.layers.attention import MultiHeadAttention
from dikkat.layers.kv_cache import AttendingCache, KVCache, SelfAttentionCache
from dikkat.layers.linear import Linear
from dikkat.layers.mlp import GatedMLP
from dikkat.layers.moe import SparseMoE
from dikkat.layers.norm import RMSNorm
from dikkat.layers.positional import RotaryEmbedding
from dikkat.models.decoder_config import (
    DECODER_PRESETS,
    FAMILIES,
    DecoderConfig,
    LayerKind,
    gemma3_layer_kinds,
)
from dikkat.models.generating import Generates
from dikkat.models.io import SaveLoad

__all__ = [
    "DECODER_PRESETS",
    "FAMILIES",
    "Decoder",
    "DecoderBlock",
    "DecoderConfig",
    "LayerKind",
    "gemma3_layer_kinds",
]


class DecoderBlock(nn.Module):
    """One block: attention and a gated MLP, each behind an RMSNorm and a residual (and, in a
    sandwich block, an RMSNorm after it too; OLMo 2's has those after only). ``window``: the
    keys a sliding layer sees."""

    def __init__(
        self,
        attn: MultiHeadAttention,
        mlp: GatedMLP | SparseMoE,
        norms: tuple[RMSNorm, RMSNorm] | None,
        post_norms: tuple[RMSNorm, RMSNorm] | None = None,
        *,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.attn, self.mlp, self.window = attn, mlp, window
        # without norms before (OLMo 2), the parts read x itself
        self.attn_norm, self.mlp_norm = (nn.Identity(), nn.Identity()) if norms is None else norms
        self.post_attn_norm, self.post_mlp_norm = (None, None) if post_norms is None else post_norms

    def forward(
        self,
        x: Tensor,
        mask: Mask | None,
        *,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: KVCache | SelfAttentionCache | AttendingCache | None = None,
    ) -> Tensor:
        """x (B, T, C) → (B, T, C); ``mask`` is this layer's (its window already applied)."""
        a = self.attn(
            self.attn_norm(x), None, mask, offset=offset, positions=positions, cache=cache
        )
        return self.after_attention(x, a)

    def after_attention(self, x: Tensor, a: Tensor) -> Tensor:
        """The rest of the block once its attention gave ``a`` for x: the residuals and the
        MLP."""
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = x + a
        m = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return x + m


def _block(c: DecoderConfig, kind: LayerKind, rope: RotaryEmbedding | None) -> DecoderBlock:
    def norm(width: int) -> RMSNorm:
        return RMSNorm(width, eps=c.norm_eps)

    attn = MultiHeadAttention(
        c.d_model,
        c.n_heads,
        n_kv_heads=c.kv_heads,
        head_dim=c.dim,
        bias=c.qkv_bias,
        out_bias=c.out_bias,
        rope=rope,
        qk_norm=_qk_norms(c, norm) if c.qk_norm else None,
        qk_norm_scope=c.qk_norm_scope,
        scale=c.attn_scale,
        softcap=c.attn_softcap,
    )
    mlp: GatedMLP | SparseMoE = (
        GatedMLP(c.d_model, c.d_ff, activation=c.activation)
        if c.n_experts == 0
        else SparseMoE(
            c.d_model,
            c.d_ff,
            n_experts=c.n_experts,
            top_k=c.experts_per_token,
            norm_topk=c.norm_topk,
            activation=c.activation,
        )
    )
    pre = (norm(c.d_model), norm(c.d_model)) if c.pre_norm else None
    post = (norm(c.d_model), norm(c.d_model)) if c.sandwich_norm else None
    window = c.sliding_window if kind == "sliding" else None
    return DecoderBlock(attn, mlp, pre, post, window=window)


def _qk_norms(c: DecoderConfig, norm: Callable[[int], RMSNorm]) -> tuple[RMSNorm, RMSNorm]:
    """The q and k norms: each head's features, or all heads' at once."""
    if c.qk_norm_scope == "head":
        return norm(c.dim), norm(c.dim)
    return norm(c.n_heads * c.dim), norm(c.kv_heads * c.dim)


class Decoder(Generates, SaveLoad, nn.Module):
    """A Llama-family or Gemma 3 decoder-only language model (see the module docstring).

    >>> model = Decoder(DecoderConfig())
    >>> model(torch.randint(0, 256, (2, 16))).shape
    torch.Size([2, 16, 256])
    """

    config_class = DecoderConfig

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        local_base = c.rope_base if c.local_rope_base is None else c.local_rope_base
        ropes: dict[LayerKind, RotaryEmbedding] = {
            "full": RotaryEmbedding(
                c.dim,
                base=c.rope_base,
                max_len=c.max_len,
                factors=c.rope_factors,
                rotary_dim=c.rotary_dim,
                long_factors=c.rope_long_factors,
                switch_at=c.rope_original_len,
                mscale=c.rope_mscale,
            ),
            "sliding": RotaryEmbedding(
                c.dim, base=local_base, max_len=c.max_len, rotary_dim=c.rotary_dim
            ),
        }
        self.blocks = nn.ModuleList(
            _block(c, kind, None if i in c.nope_layers else ropes[kind])
            for i, kind in enumerate(c.kinds)
        )
        self._ropes = tuple(ropes.values())  # shared by the blocks: forgotten at each pass
        self.norm_f = RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = Linear(c.d_model, c.vocab_size, bias=False)
        for module in self.modules():  # Llama's initialisation: N(0, 0.02), norms at 1
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def cache_layout(self) -> CacheLayout:
        c = self.config
        w = self.tok_emb.weight
        windows = tuple(block.window for block in self.blocks)
        return CacheLayout(c.n_layers, c.kv_heads, c.dim, c.max_len, w.dtype, w.device, windows)

    def embed(self, ids: Tensor, offset: int, positions: Tensor) -> Tensor:
        """ids (B, T) → (B, T, C): the token embeddings (positions enter through RoPE)."""
        x = self.tok_emb(ids)
        if self.config.embed_scale:  # Gemma: √C, rounded to the embeddings' dtype as its
            # reference does
            x = x * torch.tensor(math.sqrt(self.config.d_model), dtype=x.dtype)
        return x

    def output_logits(self, hidden: Tensor) -> Tensor:
        """The output layer, its logits soft-capped where the config says (Gemma 2)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def layer_masks(self, mask: Mask | Tensor | None) -> list[Mask | Tensor | None]:
        """Each block's mask: ``mask``, and on a sliding layer ``mask & sliding_window(w)``,
        each built once per forward, not once per layer (None: a cache that attends itself
        says which keys a query sees)."""
        if mask is None:
            return [None] * len(self.blocks)
        full = as_mask(mask)
        masks: dict[int | None, Mask] = {None: full}
        for block in self.blocks:
            if block.window not in masks:
                masks[block.window] = full & sliding_window(block.window)
        return [masks[block.window] for block in self.blocks]
