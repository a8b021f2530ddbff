"""The configuration of :class:`~dikkat.models.Decoder`: a frozen record whose fields name the
components of each family (docs/models.md, "The families"), its checks, and the presets of the
models dikkat ships (SmolLM2-135M, Gemma 3 270M)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dikkat.layers.mlp import GATE_ACTIVATIONS, GateActivation
from dikkat.layers.positional import as_rope_factors
from dikkat.presets import pick_preset
from dikkat.validate import check_bool, check_choice, check_float, check_int, check_sizes

__all__ = [
    "DECODER_PRESETS",
    "FAMILIES",
    "DecoderConfig",
    "LayerKind",
    "gemma3_layer_kinds",
]

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
    rotary_dim: int | None = None  # the first features of each head RoPE turns; None: all
    # LongRoPE (Phi-3's long-context models, Phi-4-mini): a sequence whose last position is
    # rope_original_len or more turns by these divisors instead of rope_factors; cos and sin
    # times rope_mscale
    rope_long_factors: tuple[float, ...] | None = None
    rope_original_len: int | None = None
    rope_mscale: float = 1.0
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
        check_int("rotary_dim", self.rotary_dim, optional=True)
        if self.rotary_dim is not None and (self.rotary_dim % 2 or self.rotary_dim > self.dim):
            raise ValueError(
                f"rotary_dim must be even and at most the head dim {self.dim}, got "
                f"{self.rotary_dim}"
            )
        rotated = self.dim if self.rotary_dim is None else self.rotary_dim
        for name in ("rope_factors", "rope_long_factors"):  # a JSON config gives lists
            if getattr(self, name) is not None:
                object.__setattr__(self, name, as_rope_factors(getattr(self, name), rotated))
        if (self.rope_long_factors is None) != (self.rope_original_len is None):
            raise ValueError("rope_long_factors and rope_original_len go together (LongRoPE)")
        check_int("rope_original_len", self.rope_original_len, optional=True)
        check_float("rope_mscale", self.rope_mscale, low=0.0, low_open=True)
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
