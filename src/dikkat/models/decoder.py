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
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from dikkat.core.masks import Mask, as_mask, sliding_window
from dikkat.generation.protocol import CacheLayout
from dikkat.layers.attention import MultiHeadAttention
from dikkat.layers.kv_cache import AttendingCache, KVCache, SelfAttentionCache
from dikkat.layers.linear import Linear
from dikkat.layers.mlp import GATE_ACTIVATIONS, GateActivation, GatedMLP
from dikkat.layers.moe import SparseMoE
from dikkat.layers.norm import RMSNorm
from dikkat.layers.positional import RotaryEmbedding, as_rope_factors
from dikkat.models.generating import Generates
from dikkat.models.io import SaveLoad
from dikkat.presets import pick_preset
from dikkat.validate import check_bool, check_choice, check_float, check_int, check_sizes

LayerKind = Literal["full", "sliding"]
FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3moe", "smollm3", "olmo2", "phi3", "gemma2", "gemma3"
)  # fmt: skip


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes and components of a Llama-family or Gemma 3 decoder."""

    family: str = "llama"  # what the weights came as (one of FAMILIES): a label
    vocab_size: int = 256  # V
    max_len: int = 2048  # longest sequence the positions are built for (context length)
    d_model: int = 64  # width C
    n_layers: int = 2
    n_heads: int = 4  # query heads H
    n_kv_heads: int | None = None  # key/value heads G (GQA; 1 = multi-query); None = H
    head_dim: int | None = None  # D; None = C / H (Gemma 3 sets its own)
    d_ff: int = 176  # hidden width of the gated MLP (of each expert, in a mixture)
    n_experts: int = 0  # a block's MLP is a sparse mixture of this many (Qwen3-MoE); 0: one
    experts_per_token: int = 0  # the k experts the router picks for a token, in a mixture
    norm_topk: bool = True  # the k picked probabilities renormalised to sum to 1
    activation: GateActivation = "silu"  # SwiGLU ("silu") or GeGLU with the tanh GELU
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_base: float = 10000.0  # RoPE base of the full-attention layers
    local_rope_base: float | None = None  # RoPE base of the sliding layers; None = rope_base
    # RoPE scaling of the full-attention layers: frequency i divided by rope_factors[i] (D/2
    # values; llama3_rope_factors, or one factor repeated for linear scaling); None: unscaled
    rope_factors: tuple[float, ...] | None = None
    nope_layers: tuple[int, ...] = ()  # layers whose attention has no RoPE (SmolLM3: every 4th)
    sliding_window: int | None = None  # keys a sliding layer sees, its own included
    layer_kinds: tuple[LayerKind, ...] | None = None  # "full"/"sliding" per layer; None: all
    # sliding when sliding_window is set, else all full
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    out_bias: bool = False  # a bias on the attention's output projection
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (Gemma 3, Qwen 3)
    qk_norm_scope: str = "head"  # or "width": over all heads' features at once (OLMo 2)
    pre_norm: bool = True  # norms before attention and MLP (all but OLMo 2)
    sandwich_norm: bool = False  # norms after attention and MLP, before the residual (Gemma;
    # OLMo 2's only norms)
    embed_scale: bool = False  # multiply the embeddings by √C (Gemma)
    attn_scale: float | None = None  # factor on q·k; None = 1/√D
    attn_softcap: float | None = None  # scaled scores s → c · tanh(s / c) (Gemma 2)
    final_softcap: float | None = None  # logits z → c · tanh(z / c) (Gemma 2)
    tie_embeddings: bool = True  # output projection = token embedding

    def __post_init__(self) -> None:
        check_choice("family", self.family, FAMILIES)
        check_sizes(self, "vocab_size", "max_len", "d_model", "n_layers", "n_heads", "d_ff")
        check_int("n_kv_heads", self.n_kv_heads, optional=True)
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.kv_heads} does not divide n_heads={self.n_heads}")
        check_int("head_dim", self.head_dim, optional=True)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim"
            )
        if self.dim % 2:
            raise ValueError(f"RoPE rotates pairs of features: head_dim {self.dim} must be even")
        check_choice("activation", self.activation, GATE_ACTIVATIONS)
        self._check_experts()
        check_float("norm_eps", self.norm_eps, low=0.0, low_open=True)
        check_float("rope_base", self.rope_base, low=0.0, low_open=True)
        check_float("local_rope_base", self.local_rope_base, low=0.0, low_open=True, optional=True)
        nope = tuple(self.nope_layers)  # a JSON config gives a list
        if not all(isinstance(i, int) and 0 <= i < self.n_layers for i in nope):
            raise ValueError(
                f"nope_layers must be indices of the {self.n_layers} layers, got {list(nope)}"
            )
        object.__setattr__(self, "nope_layers", tuple(sorted(set(nope))))
        if self.rope_factors is not None:  # a JSON config gives a list
            object.__setattr__(self, "rope_factors", as_rope_factors(self.rope_factors, self.dim))
        check_int("sliding_window", self.sliding_window, optional=True)
        if self.layer_kinds is not None:
            kinds = tuple(self.layer_kinds)  # a JSON config gives a list
            object.__setattr__(self, "layer_kinds", kinds)
            if len(kinds) != self.n_layers or not set(kinds) <= {"full", "sliding"}:
                raise ValueError(
                    f"layer_kinds must give 'full' or 'sliding' for each of the {self.n_layers} "
                    f"layers, got {list(kinds)}"
                )
            if "sliding" in kinds and self.sliding_window is None:
                raise ValueError("layer_kinds has sliding layers but sliding_window is None")
        for name in (
            "qkv_bias",
            "out_bias",
            "qk_norm",
            "sandwich_norm",
            "embed_scale",
            "tie_embeddings",
        ):
            check_bool(name, getattr(self, name))
        check_float("attn_scale", self.attn_scale, low=0.0, low_open=True, optional=True)
        check_choice("qk_norm_scope", self.qk_norm_scope, ("head", "width"))
        for name in ("attn_softcap", "final_softcap"):
            check_float(name, getattr(self, name), low=0.0, low_open=True, optional=True)
        check_bool("pre_norm", self.pre_norm)
        if not (self.pre_norm or self.sandwich_norm):
            raise ValueError(
                "a block needs norms before (pre_norm) or after (sandwich_norm) its parts"
            )

    def _check_experts(self) -> None:
        for name in ("n_experts", "experts_per_token"):
            check_int(name, getattr(self, name), at_least=0)
        check_bool("norm_topk", self.norm_topk)
        k, E = self.experts_per_token, self.n_experts
        if (E == 0) != (k == 0) or k > E:
            raise ValueError(
                f"experts_per_token={k} must be between 1 and n_experts={E} in a mixture of "
                "experts, and 0 without one"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def dim(self) -> int:
        """The head dim D."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's kind, "full" or "sliding"."""
        if self.layer_kinds is not None:
            return self.layer_kinds
        kind: LayerKind = "full" if self.sliding_window is None else "sliding"
        return (kind,) * self.n_layers

    @classmethod
    def preset(cls, name: str, **overrides: object) -> DecoderConfig:
        """A named configuration, optionally with some fields changed."""
        return pick_preset(DECODER_PRESETS, name, "decoder", overrides)


def gemma3_layer_kinds(n_layers: int, every: int = 6) -> tuple[LayerKind, ...]:
    """Gemma 3's pattern: every ``every``-th layer full, the others sliding."""
    return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(n_layers))


# fmt: off
DECODER_PRESETS: dict[str, DecoderConfig] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): a Llama, 30 layers, 9 query heads over 3.
    "smollm2-135m": DecoderConfig(
        family="llama",
        vocab_size=49152,
        max_len=8192,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
        rope_base=100000.0,
        norm_eps=1e-5,
    ),
    # google/gemma-3-270m: MQA with head dim 256, a 512-key window on 5 layers of 6.
    "gemma3-270m": DecoderConfig(
        family="gemma3",
        vocab_size=262144,
        max_len=32768,
        d_model=640,
        n_layers=18,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        d_ff=2048,
        activation="gelu_tanh",
        norm_eps=1e-6,
        rope_base=1_000_000.0,
        local_rope_base=10000.0,
        sliding_window=512,
        layer_kinds=gemma3_layer_kinds(18),
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=True,
        attn_scale=256**-0.5,
    ),
}
# fmt: on


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
                c.dim, base=c.rope_base, max_len=c.max_len, factors=c.rope_factors
            ),
            "sliding": RotaryEmbedding(c.dim, base=local_base, max_len=c.max_len),
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
