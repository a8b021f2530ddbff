"""One decode step of a :class:`~dikkat.models.Decoder` or a :class:`~dikkat.models.GPT` over a
static KV cache, so that every step has the same shapes and one ``torch.compile``'d graph serves
them all.

The eager step (:func:`dikkat.generation.decode_step`) attends to the cache's filled slots: a key
tensor one slot longer at every step, a position held in a Python int, and the checks of each
layer run on the host — 30 layers of SmolLM2 cost more in Python and dispatch than in reading
their weights. Here, as in gpt-fast (https://github.com/pytorch-labs/gpt-fast, ``generate.py``),
the position is a tensor, the new key and value are written into the cache's preallocated
buffers at it (``index_copy_``), and the attention reads every slot with a mask of those filled
(and, in a sliding layer, of those within its window). Compiled, the norms, RoPE and attention
of a step become a few fused kernels around the products of its weights.

The step uses the model's own modules (embeddings, norms, projections, MLPs — packed or not, and
each block's ``attention_input`` and ``after_attention``) and the same RoPE angles
(:meth:`~dikkat.layers.RotaryEmbedding.cos_sin`); what it leaves out are the eager path's input
checks, which :class:`StaticStep` does once, outside the compiled region.
"""

from __future__ import annotations

import math
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dikkat.layers.kv_cache import KVCache
from dikkat.layers.positional import rotate_half

if TYPE_CHECKING:
    from dikkat.models.decoder import Decoder
    from dikkat.models.gpt import GPT

__all__ = ["StaticStep"]


def _step(model: Decoder | GPT, keys: list[Tensor], values: list[Tensor], tokens: Tensor,
          pos: Tensor) -> Tensor:  # fmt: skip
    """Logits (B, V) of ``tokens`` (B,) at slot and position ``pos`` (a 0-d long tensor); the
    caches ``keys``/``values`` (B, G, S, D) get the new keys and values at ``pos``."""
    c = model.config
    B = tokens.shape[0]
    x = model.tok_emb(tokens[:, None])  # (B, 1, C)
    if getattr(c, "embed_scale", False):
        x = x * torch.tensor(math.sqrt(c.d_model), dtype=x.dtype)
    where = pos.view(1)
    learned = getattr(model, "pos_emb", None)
    if learned is not None:
        x = x + learned.weight[where].to(x.dtype)
    slots = torch.arange(keys[0].shape[2], device=x.device)
    filled = (slots <= pos).view(1, 1, 1, -1)  # (1, 1, 1, S): over (B, H, 1, S) scores
    tables: dict[int, tuple[Tensor, Tensor]] = {}
    for block, kc, vc in zip(model.blocks, keys, values, strict=True):
        attn = block.attn
        H, G, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        q, k, v = attn.qkv_proj(block.attention_input(x)).split(attn.qkv_sizes, dim=-1)
        q = q.view(B, 1, H, D).transpose(1, 2)  # (B, H, 1, D)
        k = k.view(B, 1, G, D).transpose(1, 2)  # (B, G, 1, D)
        v = v.view(B, 1, G, D).transpose(1, 2)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        rope = attn.rope
        if rope is not None:
            if id(rope) not in tables:
                tables[id(rope)] = rope.cos_sin(where, x.dtype)  # (1, D/2)
            cos, sin = tables[id(rope)]
            q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        kc.index_copy_(2, where, k)
        vc.index_copy_(2, where, v)
        window = getattr(block, "window", None)
        mask = filled if window is None else filled & (slots > pos - window)
        scale = attn.scale if attn.scale is not None else D**-0.5
        out = _attend(q, kc, vc, mask, scale)  # (B, H, 1, D)
        x = block.after_attention(x, attn.out_proj(out.transpose(1, 2).reshape(B, 1, H * D)))
    return model.lm_head(model.norm_f(x))[:, 0]  # (B, V)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q kᵀ · scale over the slots ``mask`` keeps) v for one query a head: q (B, H, 1,
    D), k and v (B, G, S, D) with G dividing H (grouped queries share their key head), mask
    broadcasting over (B, G, H/G, S). Written as broadcast products and sums rather than
    through SDPA or matmul, so that inductor makes loops over the cache of it, fused with the
    mask and softmax: for one query a head, SDPA's CPU kernel and two bmm calls cost more in
    each call's overhead than in their arithmetic."""
    B, H, _, D = q.shape
    G = k.shape[1]
    q = q.reshape(B, G, H // G, 1, D)
    scores = (q * k[:, :, None]).sum(-1) * scale  # (B, G, H/G, S)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (weights[..., None] * v[:, :, None]).sum(-2).view(B, H, 1, D)


_COMPILED: weakref.WeakKeyDictionary[nn.Module, Callable[..., Tensor]] = weakref.WeakKeyDictionary()


def _compiled(model: nn.Module) -> Callable[..., Tensor]:
    """:func:`_step` through ``torch.compile`` for ``model`` alone. TorchDynamo checks its
    guards before every call: on a model of 30 layers, thousands of them on the modules'
    attributes, types and tensors, which cost more than some of its kernels. This one keeps
    those on its inputs and drops the ones on the model (``guard_filter_fn``, as PyTorch's
    ``torch.compiler.skip_guard_on_all_nn_modules_unsafe`` does, in torch/compiler/__init__.py),
    which is sound only while the graph serves the model it was traced from, unchanged: so
    every model gets its own copy of the step's code, since dynamo keeps its graphs per code
    object."""
    fn = _COMPILED.get(model)
    if fn is None:
        code = _step.__code__.replace()  # a new code object: a cache of graphs of its own
        step = types.FunctionType(code, _step.__globals__, _step.__name__)
        fn = torch.compile(step, options={"guard_filter_fn": _outside_the_model})
        _COMPILED[model] = fn
    return fn


def _outside_the_model(guards: Sequence[Any]) -> list[bool]:
    """Keep the guards on anything but the model's attributes."""
    return [not g.name.startswith("model.") for g in guards]


class StaticStep:
    """Decode steps of ``model`` (a Decoder, or a GPT) over ``cache`` (its :class:`KVCache`
    list, filled by a prefill up to some slot): ``step(tokens, slot)`` feeds ``tokens`` (B,) at
    ``slot`` (the next free one, or an earlier one to overwrite, as :meth:`KVCache.update`
    allows) and returns their logits (B, V). Every row sits at the same slot and position (no
    padding). ``compile=True`` runs it through ``torch.compile`` (inductor; the
    first step compiles, in a minute or so, then every later step reuses the graph, and
    inductor keeps its compiled code on disk for the next process). The compiled graph is the
    model's own, and assumes its layers and settings stay as they were (the weights' values
    may change): a model changed after its first compiled step gets wrong results, not a new
    graph.

    >>> from dikkat.models import Decoder, DecoderConfig
    >>> model = Decoder(DecoderConfig()).eval()
    >>> cache = model.new_cache(1, 8)
    >>> _ = model(torch.tensor([[1, 2, 3]]), cache=cache)  # the prefill fills slots 0-2
    >>> StaticStep(model, cache)(torch.tensor([4]), 3).shape
    torch.Size([1, 256])
    """

    def __init__(
        self, model: Decoder | GPT, cache: Sequence[KVCache], *, compile: bool = False
    ) -> None:
        if len(cache) != len(model.blocks) or not all(isinstance(c, KVCache) for c in cache):
            raise TypeError(f"cache must hold one KVCache per layer ({len(model.blocks)})")
        self.model, self.cache = model, list(cache)
        self._keys = [c.k for c in self.cache]
        self._values = [c.v for c in self.cache]
        self._fn: Callable[..., Tensor] = _compiled(model) if compile else _step

    @torch.no_grad()
    def __call__(self, tokens: Tensor, slot: int) -> Tensor:
        B, S = self._keys[0].shape[0], self._keys[0].shape[2]
        if tokens.shape != (B,):
            raise ValueError(
                f"tokens must be ({B},), one per cached row, got {tuple(tokens.shape)}"
            )
        if not 0 <= slot < S or slot > self.cache[0].length:
            raise ValueError(
                f"slot {slot} must lie in 0 … {self.cache[0].length} (the filled length) and "
                f"below the cache's {S} slots"
            )
        if slot >= self.model.config.max_len:
            raise ValueError(
                f"slot {slot} is past the model's context of {self.model.config.max_len}"
            )
        pos = torch.tensor(slot, device=tokens.device)
        logits = self._fn(self.model, self._keys, self._values, tokens, pos)
        for c in self.cache:
            c.length = slot + 1
        return logits
