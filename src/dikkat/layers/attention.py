"""Multi-head attention as a layer: projections, heads, position injection, output projection.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` query length, ``S`` key
length, ``D`` head dim, ``C`` model width (``d_model``), ``Cc`` context width (cross-attention).

h heads each see d_k = C/h features of their own projections; their outputs are concatenated and
mapped back to C by W_O (docs/contract.md §9). With ``n_kv_heads = G < H`` several query heads
share one key/value head (grouped-query attention, §17), which shrinks the keys and values to
cache by H/G.

The q/k/v projection is one matrix, rows [q | k | v] of shape ((H + 2G)·D, C), as gpt-fast's
``wqkv`` (pytorch-labs/gpt-fast, ``model.py``), HF GPT-2's ``c_attn`` and torch's
``MultiheadAttention.in_proj_weight``: self-attention runs one product, in training and
inference alike (and one packed product in generation). State dicts keep the three names
``q_proj``/``k_proj``/``v_proj`` (state-dict hooks split and fuse them, as gpt-fast fuses ``wqkv``
at load), so checkpoints and ported weights load unchanged. With a context of another width
(``context_dim != d_model``) the layer is cross-attention only and the three stay separate, as in
torch's ``MultiheadAttention`` with ``kdim != embed_dim``.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor, nn

from dikkat.core.attention import attention, check_backend_name
from dikkat.core.masks import Mask
from dikkat.layers.inputs import check_meets
from dikkat.layers.kv_cache import AttendingCache, KVCache, SelfAttentionCache
from dikkat.layers.linear import Linear, LinearRows
from dikkat.layers.positional import ALiBi, RotaryEmbedding, resolve_positions, rotate_half
from dikkat.layers.qkv_state import fuse_qkv_state, fused_linear, split_qkv_state
from dikkat.validate import check_bool, check_choice, check_float, check_int, check_probability


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with H query heads and G key/value heads.

    Args:
        d_model: width C of x.
        n_heads: query heads H.
        n_kv_heads: key/value heads G (divides H); None → H (plain multi-head attention).
        head_dim: D; None → C / H.
        context_dim: width of the cross-attention context; None → C. Another width makes the
            layer cross-attention only, with three separate projections.
        bias: biases in the q/k/v projections, and in the output projection unless
            ``out_bias`` says otherwise (Qwen2 has the first three only).
        dropout: dropout on the attention weights during training.
        rope, alibi: position information acting inside attention (self-attention only).
        qk_norm: a pair of modules applied to each head's queries and keys (B, ·, L, D) before
            RoPE, e.g. ``(RMSNorm(D), RMSNorm(D))`` (Gemma 3, Qwen 3); None: none.
        qk_norm_scope: "head" (the norms above), or "width": applied to all heads' queries and
            keys at once (B, L, H·D) before they are split, ``(RMSNorm(H·D), RMSNorm(G·D))``
            (OLMo 2).
        scale: the factor on q·k; None → 1/√D. (Gemma 3 writes it as 1/√query_pre_attn_scalar.)
        softcap: logit soft-capping of the scaled scores, c · tanh(s / c) (Gemma 2); None: none.
        backend: the :func:`dikkat.attention` backend.

    Parameters (``context_dim == d_model``): ``qkv_proj`` ((H + 2G)·D, C), rows [q | k | v],
    and ``out_proj``; ``q_proj``, ``k_proj`` and ``v_proj`` are
    :class:`~dikkat.layers.linear.LinearRows` views of its blocks (the names the state dict
    uses). Self-attention multiplies by ``qkv_proj`` once; cross-attention by ``q_proj`` on x
    and by ``k_proj`` and ``v_proj`` on the context.

    >>> mha = MultiHeadAttention(16, 2)
    >>> y, w = mha(torch.randn(1, 5, 16), return_weights=True)
    >>> y.shape, w.shape
    (torch.Size([1, 5, 16]), torch.Size([1, 2, 5, 5]))
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        context_dim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        dropout: float = 0.0,
        rope: RotaryEmbedding | None = None,
        alibi: ALiBi | None = None,
        qk_norm: tuple[nn.Module, nn.Module] | None = None,
        qk_norm_scope: str = "head",
        scale: float | None = None,
        softcap: float | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_int("d_model", d_model)
        check_int("n_heads", n_heads)
        check_int("n_kv_heads", n_kv_heads, at_least=None, optional=True)  # range: just below
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ValueError(
                f"n_kv_heads={n_kv_heads} must be positive and divide n_heads={n_heads}"
            )
        check_int("head_dim", head_dim, optional=True)
        check_int("context_dim", context_dim, optional=True)
        check_bool("bias", bias)
        out_bias = bias if out_bias is None else check_bool("out_bias", out_bias)
        check_probability("dropout", dropout)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim"
                )
            head_dim = d_model // n_heads
        _check_position_modules(rope, alibi, head_dim, n_heads)
        check_float("scale", scale, low=0.0, low_open=True, optional=True)
        check_float("softcap", softcap, low=0.0, low_open=True, optional=True)
        self.softcap = softcap
        context_dim = d_model if context_dim is None else context_dim
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim, self.context_dim = head_dim, context_dim
        self.dropout, self.backend = dropout, backend
        self.rope, self.alibi, self.scale = rope, alibi, scale
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            if not (isinstance(qk_norm, tuple) and len(qk_norm) == 2):
                raise TypeError("qk_norm must be a pair of modules (for q, for k) or None")
            self.q_norm, self.k_norm = qk_norm
        check_choice("qk_norm_scope", qk_norm_scope, ("head", "width"))
        self.qk_norm_scope = qk_norm_scope
        q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
        self.qkv_sizes: tuple[int, int, int] = (q_size, kv_size, kv_size)  # rows of q, k, v
        # Fused: q/k/v_proj are views of qkv_proj's row blocks. Separate: three Linears.
        self.qkv_proj: Linear | None = None
        self.q_proj: Linear | LinearRows
        self.k_proj: Linear | LinearRows
        self.v_proj: Linear | LinearRows
        if context_dim == d_model:
            self.qkv_proj = fused_linear(d_model, self.qkv_sizes, bias)
            starts = (0, q_size, q_size + kv_size, q_size + 2 * kv_size)
            self.q_proj, self.k_proj, self.v_proj = (
                LinearRows(self.qkv_proj, a, b) for a, b in pairwise(starts)
            )
            self.register_state_dict_post_hook(split_qkv_state)
            self.register_load_state_dict_pre_hook(fuse_qkv_state)
        else:
            self.q_proj = Linear(d_model, q_size, bias=bias)
            self.k_proj = Linear(context_dim, kv_size, bias=bias)
            self.v_proj = Linear(context_dim, kv_size, bias=bias)
        self.out_proj = Linear(q_size, d_model, bias=out_bias)

    @property
    def backend(self) -> str:
        """The :func:`dikkat.attention` backend; may be changed on a built layer."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend = check_backend_name("backend", name)  # now, not at the first forward

    def _heads(self, t: Tensor, n: int) -> Tensor:
        B, L, _ = t.shape
        return t.view(B, L, n, self.head_dim).transpose(1, 2)  # (B, L, n·D) → (B, n, L, D)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask: Mask | Tensor | None = None,
        *,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: KVCache | SelfAttentionCache | AttendingCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x (B, T, C) to itself, or to ``context`` (B, S, Cc) for cross-attention.

        The one forward of a layer's attention: training, the eager decode, the static and the
        pooled decode steps of :mod:`dikkat.models.static_step` all run it (:meth:`project`,
        then the cache's attention, then :meth:`merge`); what differs between them is the
        ``cache``.

        Args:
            mask: True = may attend, over the (B, H, T, S) scores. With a cache, key j is cache
                slot j and query i sits at slot ``offset + i``; without one, keys are x's tokens.
            offset: cache slot (and, unless ``positions`` is given, position) of x's first token.
            positions: explicit positions (T,) or (B, T) of x's tokens, for RoPE.
            cache: self-attention: x's keys/values are written at ``offset`` and all filled slots
                are attended (any :class:`~dikkat.layers.kv_cache.SelfAttentionCache`); or an
                :class:`~dikkat.layers.kv_cache.AttendingCache`, which stores them and attends
                itself (``mask`` and ``offset`` unused).
                Cross-attention: a :class:`KVCache`, filled from ``context`` on first use and
                reused after, so the source is projected once per generation.
            return_weights: also return the weights (B, H, T, S).
        """
        self._check_input("x", x, self.d_model)
        bias, q_offset = None, 0
        if context is not None:
            q = self._heads(self.q_proj(x), self.n_heads)  # (B, H, T, D)
            k, v = self._cross_kv(x, context, cache)  # (B, G, S, D) each
        else:
            pos = None
            if self.rope is not None:
                pos = resolve_positions(x.shape[1], offset, positions, x.device)
            q, k, v = self.project(x, pos)  # (B, H, T, D), (B, G, T, D) × 2
            if isinstance(cache, AttendingCache):
                if self.alibi is not None or return_weights:
                    raise ValueError(
                        "an AttendingCache attends without ALiBi's bias and returns no weights"
                    )
                scale = self.head_dim**-0.5 if self.scale is None else self.scale
                return self.merge(cache.attend(q, k, v, scale, self.softcap))
            if cache is not None:
                k, v = cache.update(offset, k, v)  # (B, G, offset + T, D): every filled slot
                q_offset = offset
            if self.alibi is not None:
                # ALiBi needs only distances, and slot distance equals position distance.
                q_idx = torch.arange(q_offset, q_offset + x.shape[1], device=x.device)
                # kept in fp32: attention adds it to the scores there (a bf16 bias of a few
                # hundred is rounded to steps of 2)
                bias = self.alibi.bias(q_idx, torch.arange(k.shape[2], device=x.device))

        result = attention(
            q,
            k,
            v,
            mask,
            bias=bias,
            scale=self.scale,
            softcap=self.softcap,
            q_offset=q_offset,
            dropout=self.dropout if self.training else 0.0,
            backend=self.backend,
            return_weights=return_weights,
        )
        out, aux = result if isinstance(result, tuple) else (result, None)
        y = self.merge(out)
        return y if aux is None else (y, aux.weights)

    def project(self, x: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (B, G, T, D) of x (B, T, C): one product with
        the fused weight, split into heads, the q/k norms, then RoPE at ``positions`` (T,) or
        (B, T) (:meth:`RotaryEmbedding.angles`; needed with RoPE). The one place a layer's
        self-attention inputs are made."""
        if self.qkv_proj is None:
            raise ValueError(
                f"this layer projects keys and values from a context of width "
                f"{self.context_dim} (context_dim), not from x of width {self.d_model}: "
                "pass a context (it is cross-attention only)"
            )
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # (B, T, H·D), (B, T, G·D) × 2
        if self.q_norm is not None and self.qk_norm_scope == "width":
            q, k = self.q_norm(q), self.k_norm(k)  # over all heads' features at once (OLMo 2)
        q, k = self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads)
        v = self._heads(v, self.n_kv_heads)
        if self.q_norm is not None and self.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            if positions is None:
                raise ValueError("a layer with RoPE needs the positions of x's tokens")
            cos, sin = self.rope.angles(positions, q.dtype)
            q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        return q, k, v

    def merge(self, out: Tensor) -> Tensor:
        """The heads' outputs (B, H, T, D) → (B, T, C): concatenated, then W_O."""
        B, H, T, D = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, T, H * D))

    def _cross_kv(
        self, x: Tensor, context: Tensor, cache: KVCache | SelfAttentionCache | None
    ) -> tuple[Tensor, Tensor]:
        """Keys and values of the context: projected now, or read from a filled cross cache."""
        self._check_input("context", context, self.context_dim)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(
                f"cross-attention keeps its keys in a KVCache (read back whole after the first "
                f"step), got cache of type {type(cache).__name__}"
            )
        if context.shape[0] != x.shape[0]:
            raise ValueError(
                f"context batch {context.shape[0]} differs from x batch {x.shape[0]}: "
                f"x {tuple(x.shape)}, context {tuple(context.shape)}"
            )
        if cache is not None and cache.length > 0:
            return cache.k[:, :, : cache.length], cache.v[:, :, : cache.length]
        k = self._heads(self.k_proj(context), self.n_kv_heads)  # (B, G, S, D)
        v = self._heads(self.v_proj(context), self.n_kv_heads)
        if cache is not None:
            k, v = cache.update(0, k, v)
        return k, v

    def _check_input(self, name: str, t: Tensor, width: int) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3 or t.shape[-1] != width:
            raise ValueError(f"{name} must have shape (B, L, {width}), got {tuple(t.shape)}")
        if self.qkv_proj is not None:
            weight = self.qkv_proj.weight
        else:
            weight = (self.q_proj if name == "x" else self.k_proj).weight
        check_meets(name, t, weight, "MultiHeadAttention")

    def hold_qkv(self, layer: nn.Module) -> None:
        """Make ``layer`` the fused q/k/v projection, rows [q | k | v] (e.g. a packed layer a
        loader built from a file's blocks), with ``q_proj``, ``k_proj`` and ``v_proj`` views of
        its rows, as :meth:`__init__` builds them around a ``Linear``."""
        if self.qkv_proj is None:
            raise ValueError("a cross-attention layer (context_dim != d_model) has no fused q/k/v")
        shape = (getattr(layer, "out_features", None), getattr(layer, "in_features", None))
        if shape != (sum(self.qkv_sizes), self.d_model):
            raise ValueError(
                f"the q/k/v layer must be ({sum(self.qkv_sizes)}, {self.d_model}), got {shape}"
            )
        self.qkv_proj = layer  # type: ignore[assignment]
        q, kv = self.qkv_sizes[0], self.qkv_sizes[1]
        starts = (0, q, q + kv, q + 2 * kv)
        self.q_proj, self.k_proj, self.v_proj = (
            LinearRows(layer, a, b)
            for a, b in pairwise(starts)  # type: ignore[arg-type]
        )

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """A layer with the weights of ``torch.nn.MultiheadAttention`` ``m`` (same outputs).

        Our layer is batch-first; convert torch's masks with :func:`dikkat.masks.from_torch_mask`
        (torch's True means *blocked*).
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(m).__name__}")
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no dikkat equivalent")
        if m.kdim != m.vdim:
            raise ValueError(
                f"kdim={m.kdim} and vdim={m.vdim} differ; dikkat uses one context width"
            )
        has_bias = m.in_proj_bias is not None
        layer = cls(
            m.embed_dim,
            m.num_heads,
            context_dim=m.kdim,
            bias=has_bias,
            dropout=m.dropout,
        ).to(device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype)
        E = m.embed_dim
        if m._qkv_same_embed_dim:
            wq, wk, wv = m.in_proj_weight.split(E, dim=0)
        else:
            wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        state = {"q_proj.weight": wq, "k_proj.weight": wk, "v_proj.weight": wv}
        state["out_proj.weight"] = m.out_proj.weight
        if has_bias:
            bq, bk, bv = m.in_proj_bias.split(E)
            state |= {"q_proj.bias": bq, "k_proj.bias": bk, "v_proj.bias": bv}
            state["out_proj.bias"] = m.out_proj.bias
        layer.load_state_dict(state)  # our state-dict names, fused on load where fused
        return layer


def _check_position_modules(
    rope: RotaryEmbedding | None, alibi: ALiBi | None, head_dim: int, n_heads: int
) -> None:
    """RoPE and ALiBi, when given, are the modules and sizes this attention needs."""
    for name, module, kind in (("rope", rope, RotaryEmbedding), ("alibi", alibi, ALiBi)):
        if module is not None and not isinstance(module, kind):
            got = type(module).__name__
            raise TypeError(f"{name} must be a {kind.__name__} or None, got {got}")
    if rope is not None and rope.head_dim != head_dim:
        raise ValueError(f"rope was built for head_dim {rope.head_dim}, attention has {head_dim}")
    if alibi is not None and alibi.n_heads != n_heads:
        raise ValueError(f"alibi was built for {alibi.n_heads} heads, attention has {n_heads}")
