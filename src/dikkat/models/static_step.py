"""One decode step of a decoder (:class:`~dikkat.generation.protocol.LayeredLM`: a
:class:`~dikkat.models.Decoder`, a :class:`~dikkat.models.GPT`) over a static KV cache, so that
every step has the same shapes and one ``torch.compile``'d graph serves them all.

The eager step (:func:`dikkat.generation.decode_step`) attends to the cache's filled slots: a key
tensor one slot longer at every step, a position held in a Python int, and the checks of each
layer run on the host — 30 layers of SmolLM2 cost more in Python and dispatch than in reading
their weights. Here, as in gpt-fast (https://github.com/pytorch-labs/gpt-fast, ``generate.py``),
the position is a tensor, the new key and value are written into the cache's preallocated
buffers at it (``index_copy_``), and the attention reads every slot with a mask of those filled
(and, in a sliding layer, of those within its window). Compiled, the norms, RoPE and attention
of a step become a few fused kernels around the products of its weights. A single row (batch 1,
fp32 on the CPU) attends in the native kernel of :class:`PoolStep` instead, its cache read in
place as a pool of slots: only the filled ones are read, not the whole cache at every step.

:class:`PoolStep` is its sibling for a batch whose rows sit at positions of their own, their keys
and values at any slots of per-layer pools (a paged cache, as the serving engine keeps it):
each row's position is its own in the RoPE angles and the masks, and the attention runs in a
native kernel over the rows' slots where one is built.

Both run the model's own forward past its input checks (``model.run``: embedding, blocks, each
layer's :meth:`~dikkat.layers.MultiHeadAttention.forward`, final norm and head), with a cache per
layer that stores and attends its own way (:class:`~dikkat.layers.kv_cache.AttendingCache`):
:class:`StaticSlots` and :class:`PooledSlots` here are all that differs from the eager forward.
The input checks run in :class:`StaticStep` and :class:`PoolStep`, outside the compiled region.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor, nn

from dikkat.generation.protocol import LayeredLM
from dikkat.kernels import paged_attention_op
from dikkat.layers.kv_cache import AttendingCache, KVCache

__all__ = ["PoolStep", "PooledSlots", "StaticSlots", "StaticStep"]

Masks = dict[int | None, Tensor]  # window → the slots kept, shared by a step's layers


class StaticSlots(AttendingCache):
    """One layer's static cache ``keys``/``values`` (B, G, S, D) in a decode step at slot and
    position ``where`` (1,) (``slots``: 0 … S − 1): the new key and value are written there,
    and the query attends to slots 0 … where (the last ``window`` of them in a sliding layer):
    in the native kernel (``native``, for one fp32 row on the CPU), or by :func:`_attend` over
    every slot, masked.
    ``masks`` is shared by the layers of one step, so that each window's mask is built once."""

    def __init__(self, keys: Tensor, values: Tensor, slots: Tensor, where: Tensor,
                 window: int | None, native: Callable[..., Tensor] | None,
                 masks: Masks) -> None:  # fmt: skip
        self.keys, self.values, self.slots, self.where = keys, values, slots, where
        self.window, self.native, self.masks = window, native, masks

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None
    ) -> Tensor:
        keys, values, slots, where, window = (
            self.keys, self.values, self.slots, self.where, self.window
        )  # fmt: skip
        keys.index_copy_(2, where, k)
        values.index_copy_(2, where, v)
        if (
            self.native is not None and softcap is None
        ):  # the kernel does not cap  # one row's cache (1, G, S, D) is a pool of S slots
            pool_k, pool_v = keys[0].transpose(0, 1), values[0].transpose(0, 1)
            out = self.native(q[:, :, 0], pool_k, pool_v, slots.view(1, -1), where, window or 0,
                              scale)  # fmt: skip
            return out[:, :, None]
        if window not in self.masks:  # (1, 1, 1, S): over (B, H, 1, S) scores
            kept = slots <= where
            kept = kept if window is None else kept & (slots > where - window)
            self.masks[window] = kept.view(1, 1, 1, -1)
        return _attend(q, keys, values, self.masks[window], scale, softcap)


class PooledSlots(AttendingCache):
    """One layer's pools ``keys``/``values`` (N, G, D) in a decode step of rows at positions
    ``where`` (B, 1) of their own, row b's token j at pool slot ``slots[b, j]`` (B, S): the new
    keys and values go to ``write`` (B,) (``slots[b, where[b]]``), and row b attends to its
    columns 0 … where[b] (the last ``window`` of them in a sliding layer) — in the native
    kernel where built, else by :func:`_attend` over the gathered slots, masked."""

    def __init__(self, keys: Tensor, values: Tensor, slots: Tensor, where: Tensor, write: Tensor,
                 window: int | None, native: Callable[..., Tensor] | None,
                 masks: Masks) -> None:  # fmt: skip
        self.keys, self.values, self.slots, self.where = keys, values, slots, where
        self.write, self.window, self.native, self.masks = write, window, native, masks

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None
    ) -> Tensor:
        keys, values, slots, where, window = (
            self.keys, self.values, self.slots, self.where, self.window
        )  # fmt: skip
        keys.index_copy_(0, self.write, k[:, :, 0])  # k, v (B, G, 1, D)
        values.index_copy_(0, self.write, v[:, :, 0])
        if self.native is not None and softcap is None:  # the kernel does not cap
            out = self.native(q[:, :, 0], keys, values, slots, where.view(-1), window or 0, scale)
            return out[:, :, None]
        if window not in self.masks:  # (B, 1, 1, S)
            B, S = slots.shape
            columns = torch.arange(S, device=slots.device)
            kept = columns <= where
            kept = kept if window is None else kept & (columns > where - window)
            self.masks[window] = kept.view(B, 1, 1, S)
        k_all, v_all = keys[slots].transpose(1, 2), values[slots].transpose(1, 2)
        return _attend(q, k_all, v_all, self.masks[window], scale, softcap)  # gathered slots


def _step(model: LayeredLM, windows: tuple[int | None, ...], keys: list[Tensor],
          values: list[Tensor], tokens: Tensor, pos: Tensor) -> Tensor:  # fmt: skip
    """Logits (B, V) of ``tokens`` (B,) at slot and position ``pos`` (a 0-d long tensor); the
    caches ``keys``/``values`` (B, G, S, D) get the new keys and values at ``pos``; layer i
    sees the last ``windows[i]`` keys (None: all)."""
    where = pos.view(1)
    slots = torch.arange(keys[0].shape[2], device=tokens.device)
    native = paged_attention_op() if _one_cpu_row(keys[0]) else None
    masks: Masks = {}
    cache = [
        StaticSlots(k, v, slots, where, window, native, masks)
        for k, v, window in zip(keys, values, windows, strict=True)
    ]
    return model.run(tokens[:, None], None, positions=where, cache=cache)[:, 0]  # (B, V)


def _pool_step(model: LayeredLM, windows: tuple[int | None, ...], keys: list[Tensor],
               values: list[Tensor], tokens: Tensor, positions: Tensor,
               slots: Tensor) -> Tensor:  # fmt: skip
    """Logits (B, V) of ``tokens`` (B,), row b at its own position ``positions[b]``; the pools
    ``keys``/``values`` (N, G, D) hold row b's token j at slot ``slots[b, j]`` (B, S), and get
    the new keys and values at ``slots[b, positions[b]]``; layer i sees the last
    ``windows[i]`` keys (None: all)."""
    B = slots.shape[0]
    where = positions.view(B, 1)
    write = slots.gather(1, where).view(B)
    native = paged_attention_op() if keys[0].dtype == torch.float32 and keys[0].is_cpu else None
    masks: Masks = {}
    cache = [
        PooledSlots(k, v, slots, where, write, window, native, masks)
        for k, v, window in zip(keys, values, windows, strict=True)
    ]
    return model.run(tokens[:, None], None, positions=where, cache=cache)[:, 0]  # (B, V)


def _one_cpu_row(keys: Tensor) -> bool:
    """Whether a static cache (B, G, S, D) is one fp32 row on the CPU: the native kernel's case."""
    return keys.shape[0] == 1 and keys.dtype == torch.float32 and keys.is_cpu


def _attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None = None
) -> Tensor:
    """softmax(q kᵀ · scale over the slots ``mask`` keeps) v for one query a head (the scaled
    scores s soft-capped to ``softcap`` · tanh(s / ``softcap``) first, where given): q (B, H, 1,
    D), k and v (B, G, S, D) with G dividing H (grouped queries share their key head), mask
    broadcasting over (B, G, H/G, S). Written as broadcast products and sums rather than
    through SDPA or matmul, so that inductor makes loops over the cache of it, fused with the
    mask and softmax: for one query a head, SDPA's CPU kernel and two bmm calls cost more in
    each call's overhead than in their arithmetic."""
    B, H, _, D = q.shape
    G = k.shape[1]
    q = q.reshape(B, G, H // G, 1, D)
    scores = (q * k[:, :, None]).sum(-1) * scale  # (B, G, H/G, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (weights[..., None] * v[:, :, None]).sum(-2).view(B, H, 1, D)


_COMPILED: weakref.WeakKeyDictionary[nn.Module, dict[str, Callable[..., Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def _compiled(model: nn.Module, step: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``step`` through ``torch.compile`` for ``model`` alone. TorchDynamo checks its
    guards before every call: on a model of 30 layers, thousands of them on the modules'
    attributes, types and tensors, which cost more than some of its kernels. This one keeps
    those on its inputs and drops the ones on the model (``guard_filter_fn``, as PyTorch's
    ``torch.compiler.skip_guard_on_all_nn_modules_unsafe`` does, in torch/compiler/__init__.py),
    which is sound only while the graph serves the model it was traced from, unchanged: so
    every model gets its own copy of the step's code, since dynamo keeps its graphs per code
    object.

    On the CPU the graph's calls run from C++ (inductor's ``cpp_wrapper``), not from a Python
    function: a step of a 30-layer model calls a few hundred kernels, and each call from Python
    costs microseconds of the interpreter's time (BENCHMARKS.md, "compiled steps call their
    kernels from C++"). The wrapper is compiled apart from the kernels
    (``cpp_wrapper_build_separate``, https://github.com/pytorch/pytorch/pull/148773): compiled
    together, a 30-layer model's long wrapper made its first step much slower to build."""
    steps = _COMPILED.setdefault(model, {})
    fn = steps.get(step.__name__)
    if fn is None:
        code = step.__code__.replace()  # a new code object: a cache of graphs of its own
        copy = types.FunctionType(code, step.__globals__, step.__name__)
        options: dict[str, Any] = {"guard_filter_fn": _outside_the_model}
        if all(p.device.type == "cpu" for p in model.parameters()):
            options |= {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
        fn = torch.compile(copy, options=options)
        steps[step.__name__] = fn
    return fn


def _outside_the_model(guards: Sequence[Any]) -> list[bool]:
    """Keep the guards on anything but the model's attributes."""
    return [not g.name.startswith("model.") for g in guards]


class StaticStep:
    """Decode steps of ``model`` (a :class:`~dikkat.generation.protocol.LayeredLM`: a Decoder, a
    GPT) over ``cache`` (its :class:`KVCache` list, filled by a prefill up to some slot):
    ``step(tokens, slot)`` feeds ``tokens`` (B,) at ``slot`` (the next free one, or an earlier
    one to overwrite, as :meth:`KVCache.update` allows) and returns their logits (B, V). Every
    row sits at the same slot and position (no padding). ``compile=True`` runs it through
    ``torch.compile`` (inductor; the first step compiles, in a minute or so, then every later
    step reuses the graph, and inductor keeps its compiled code on disk for the next process).
    One fp32 row on the CPU attends in dikkat's native kernel, which the construction of the
    first such step on a machine builds (about a minute, then cached on disk; without a
    compiler, the masked products serve). The compiled graph is the model's own, and assumes its
    layers and settings stay as they were (the weights' values may change): a model changed
    after its first compiled step gets wrong results, not a new graph.

    >>> from dikkat.models import Decoder, DecoderConfig
    >>> model = Decoder(DecoderConfig()).eval()
    >>> cache = model.new_cache(1, 8)
    >>> _ = model(torch.tensor([[1, 2, 3]]), cache=cache)  # the prefill fills slots 0-2
    >>> StaticStep(model, cache)(torch.tensor([4]), 3).shape
    torch.Size([1, 256])
    """

    def __init__(
        self, model: LayeredLM, cache: Sequence[KVCache], *, compile: bool = False
    ) -> None:
        layout = model.cache_layout()
        if len(cache) != layout.n_layers or not all(isinstance(c, KVCache) for c in cache):
            raise TypeError(f"cache must hold one KVCache per layer ({layout.n_layers})")
        self._windows = tuple(layout.window(i) for i in range(layout.n_layers))
        self.model, self.cache = model, list(cache)
        self._keys = [c.k for c in self.cache]
        self._values = [c.v for c in self.cache]
        if _one_cpu_row(self._keys[0]):
            paged_attention_op()  # looked up (and built, the first time) outside a compiled region
        self._fn: Callable[..., Tensor] = _compiled(model, _step) if compile else _step

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
        logits = self._fn(self.model, self._windows, self._keys, self._values, tokens, pos)
        for c in self.cache:
            c.length = slot + 1
        return logits


class PoolStep:
    """Decode steps of ``model`` (a :class:`~dikkat.generation.protocol.LayeredLM`) for rows at
    positions of their own, their keys and values in pools of slots (a paged cache):
    ``keys[i]``/``values[i]`` (N, G, D) hold layer i's. ``step(tokens, positions, slots)``
    feeds ``tokens`` (B,), row b at position ``positions[b]``, whose earlier tokens j sit at
    pool slot ``slots[b, j]`` (B, S; S past every row's position, the later columns ignored);
    its new keys and values go to slot ``slots[b, positions[b]]``. Returns the logits (B, V).
    Every entry of ``slots`` must name a slot of the pools, the ignored columns too (a padded
    block table's block 0 does).

    ``compile=True`` runs it through ``torch.compile`` with the batch and S symbolic, so that one
    graph serves every step as rows come and go and grow (one more for a batch of one row, which
    dynamo keeps apart). The compiled graph is the model's own, as in :class:`StaticStep`.

    >>> from dikkat.models import Decoder, DecoderConfig
    >>> model = Decoder(DecoderConfig()).eval()
    >>> layout = model.cache_layout()
    >>> pool = [torch.zeros(64, layout.kv_heads, layout.head_dim) for _ in range(layout.n_layers)]
    >>> step = PoolStep(model, pool, [torch.zeros_like(p) for p in pool])
    >>> slots = torch.tensor([[0, 1, 2], [8, 9, 10]])  # row 0 at slots 0-2, row 1 at 8-10
    >>> step(torch.tensor([5, 6]), torch.tensor([0, 0]), slots).shape  # both rows' first token
    torch.Size([2, 256])
    """

    def __init__(
        self,
        model: LayeredLM,
        keys: Sequence[Tensor],
        values: Sequence[Tensor],
        *,
        compile: bool = False,
    ) -> None:
        layout = model.cache_layout()
        shape = (layout.kv_heads, layout.head_dim)
        for name, pools in (("keys", keys), ("values", values)):
            if len(pools) != layout.n_layers or any(
                p.dim() != 3 or tuple(p.shape[1:]) != shape or p.shape[0] != keys[0].shape[0]
                for p in pools
            ):
                raise ValueError(
                    f"{name} must hold one (N, {shape[0]}, {shape[1]}) pool per layer "
                    f"({layout.n_layers}), all of one N; got "
                    f"{[tuple(p.shape) for p in pools]}"
                )
        self.model = model
        self._windows = tuple(layout.window(i) for i in range(layout.n_layers))
        self._keys, self._values = list(keys), list(values)
        paged_attention_op()  # looked up (and built, the first time) outside a compiled region
        self._fn: Callable[..., Tensor] = _compiled(model, _pool_step) if compile else _pool_step
        self._compiled = compile

    @torch.no_grad()
    def __call__(self, tokens: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        for name, t in (("tokens", tokens), ("positions", positions), ("slots", slots)):
            if not isinstance(t, Tensor) or t.dtype != torch.long:
                kind = t.dtype if isinstance(t, Tensor) else type(t).__name__
                raise TypeError(f"{name} must be an int64 tensor, got {kind}")
        B = tokens.shape[0] if tokens.dim() == 1 else -1
        if B < 1 or positions.shape != (B,) or slots.dim() != 2 or slots.shape[0] != B:
            raise ValueError(
                f"tokens (B,), positions (B,) and slots (B, S) must agree, got "
                f"{tuple(tokens.shape)}, {tuple(positions.shape)}, {tuple(slots.shape)}"
            )
        S, N = slots.shape[1], self._keys[0].shape[0]
        V = self.model.config.vocab_size
        if int(tokens.min()) < 0 or int(tokens.max()) >= V:
            raise ValueError(f"tokens must lie in 0 … {V - 1}, got {tokens.tolist()}")
        top = int(positions.max())
        if int(positions.min()) < 0 or top >= S or top >= self.model.config.max_len:
            raise ValueError(
                f"positions must lie in 0 … {min(S, self.model.config.max_len) - 1} (below the "
                f"{S} columns of slots and the model's context of "
                f"{self.model.config.max_len}), got {positions.tolist()}"
            )
        if int(slots.min()) < 0 or int(slots.max()) >= N:
            raise ValueError(f"slots must lie in 0 … {N - 1}, the pools' slots")
        if not self._compiled:
            return self._fn(
                self.model, self._windows, self._keys, self._values, tokens, positions, slots
            )
        # the sizes that vary from step to step are symbolic, not a new graph each; each its own
        # symbol, even where two are equal when traced (dynamo's "duck" sizing would make one of
        # B = S = 2, and the graph would hold for B = S alone)
        if S > 1:
            torch._dynamo.mark_dynamic(slots, 1)
        if B > 1:
            for t in (tokens, positions, slots):
                torch._dynamo.mark_dynamic(t, 0)
        with fx_config.patch(use_duck_shape=False):
            return self._fn(
                self.model, self._windows, self._keys, self._values, tokens, positions, slots
            )
