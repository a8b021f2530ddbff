"""What the decoder-only language models share: their forward (input checks, then embedding,
blocks, final norm and head, the one loop that the eager pass and the decode steps run), their KV
caches and decode steps, a tied output embedding, and ``model.generate``, their one way into
:func:`dikkat.generate`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from dikkat.core.masks import Mask, as_mask, causal, padding
from dikkat.generation.generate import Prompts, generate
from dikkat.generation.protocol import CacheLayout
from dikkat.generation.sampling import Sampling, SamplingParams
from dikkat.layers.inputs import check_token_ids, check_valid
from dikkat.layers.kv_cache import AttendingCache, KVCache, SelfAttentionCache
from dikkat.layers.linear import LinearRows
from dikkat.layers.positional import RotaryEmbedding, resolve_positions, valid_positions
from dikkat.models.aot_step import compiled_pool_step, compiled_step
from dikkat.models.holding import HoldsWeights
from dikkat.models.static_step import PoolStep, StaticStep
from dikkat.validate import check_int
from dikkat.weights.formats import WeightFormat
from dikkat.weights.held import HeldWeight


class Generates(HoldsWeights):
    """Mixin for an ``nn.Module`` decoder (``GPT``, ``Decoder``) that meets
    :class:`dikkat.generation.DecoderLM`: it has ``config`` (with ``tie_embeddings``,
    ``vocab_size``), ``tok_emb``, ``blocks`` (each called as ``block(x, mask, offset=…,
    positions=…, cache=…)``), ``norm_f``, ``lm_head``, its RoPE modules in ``_ropes``, and
    :meth:`cache_layout` and :meth:`embed`; it takes a file's weights by
    :meth:`~dikkat.models.holding.HoldsWeights.hold`."""

    config: Any
    tok_emb: nn.Embedding
    blocks: nn.ModuleList
    norm_f: nn.Module
    lm_head: nn.Module
    _ropes: tuple[RotaryEmbedding, ...]

    def cache_layout(self) -> CacheLayout:
        raise NotImplementedError

    def embed(self, ids: Tensor, offset: int, positions: Tensor) -> Tensor:
        """ids (B, T) at ``positions`` (T,) or (B, T) → the first block's input (B, T, C)."""
        raise NotImplementedError

    def layer_masks(self, mask: Mask | Tensor | None) -> list[Mask | Tensor | None]:
        """Each block's mask, from the model's ``mask``: the same for all here."""
        return [mask] * len(self.blocks)

    def is_tied(self, name: str) -> bool:
        """True for a parameter stored under another name (the tied output embedding)."""
        return self.config.tie_embeddings and name == "lm_head.weight"

    def forward(
        self,
        ids: Tensor,
        mask: Mask | Tensor | None = None,
        *,
        valid: Tensor | None = None,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: Sequence[KVCache | SelfAttentionCache] | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
    ) -> Tensor:
        """ids (B, T) → logits (B, T, V) (or the final hidden states (B, T, C)).

        Args:
            mask: the attention mask, default ``causal()``. A general override, not the padding
                argument: a given mask replaces the causal one (write ``causal() & …`` to keep
                it), e.g. ``full()`` to train without it (docs/contract.md §5). A sliding layer
                adds its window to whatever mask it is given.
            valid: (B, T) bool, False at padding (HF's ``attention_mask`` as bool), on the left
                or the right. The pads are hidden as keys: the mask becomes
                ``mask & padding(valid=valid)`` (``causal() & padding(valid=valid)`` by default),
                and unless ``positions`` is given each row's positions count from its first real
                token, so every row computes what it would alone. ``valid`` describes ``ids``
                only, so it needs ``offset=0``; a decode step after cached pads passes ``mask``
                and ``positions`` itself (as :func:`dikkat.generation.decode_step` does).
            offset: cache slot (and default position) of ids[:, 0].
            positions: explicit positions (T,) or (B, T).
            cache: per-layer KV caches from :meth:`new_cache`, filled at ``offset``; or any
                per-layer :class:`~dikkat.layers.kv_cache.SelfAttentionCache` (the paged cache
                of :class:`dikkat.serving.Engine`).
            last_only: logits of the last position only, (B, 1, V) (what generation needs).
            return_hidden: the final hidden states (B, T, C), after the final norm.
        """
        mask, positions = self.forward_inputs(ids, mask, valid, offset, positions, cache)
        # one positions tensor for every layer: RoPE computes its table once per pass
        positions = resolve_positions(ids.shape[1], offset, positions, ids.device)
        for rope in self._ropes:
            rope.forget()
        return self.run(
            ids,
            mask,
            offset=offset,
            positions=positions,
            cache=cache,
            last_only=last_only,
            return_hidden=return_hidden,
        )

    def run(
        self,
        ids: Tensor,
        mask: Mask | Tensor | None,
        *,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: Sequence[KVCache | SelfAttentionCache | AttendingCache] | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
    ) -> Tensor:
        """The forward past its input checks: embedding, blocks, final norm and head. The eager
        pass runs it with :meth:`forward`'s checked arguments; a decode step
        (:mod:`dikkat.models.static_step`) with a tensor of ``positions`` and a cache that
        attends itself (:class:`~dikkat.layers.kv_cache.AttendingCache`), its checks done
        outside its compiled region."""
        if positions is None:
            positions = resolve_positions(ids.shape[1], offset, None, ids.device)
        x = self.embed(ids, offset, positions)  # (B, T, C)
        masks = self.layer_masks(mask)
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache[i]
            x = block(x, masks[i], offset=offset, positions=positions, cache=layer_cache)
        if last_only:
            x = x[:, -1:]
        x = self.norm_f(x)
        return x if return_hidden else self.output_logits(x)  # (B, T, V)

    def output_logits(self, hidden: Tensor) -> Tensor:
        """The output layer on final hidden states (B, T, C) → logits (B, T, V)."""
        return self.lm_head(hidden)

    def static_step(self, cache: Sequence[KVCache], *, compile: bool = False) -> StaticStep:
        """Decode steps over ``cache`` with static shapes
        (:class:`~dikkat.models.static_step.StaticStep`); ``compile=True``: compiled, ahead of
        time and kept on disk for one row on the CPU (:class:`~dikkat.models.aot_step.AotStep`),
        else by ``torch.compile``, eager with a line on stderr where neither builds
        (:func:`~dikkat.models.aot_step.compiled_step`)."""
        if compile:
            return compiled_step(self, cache)  # type: ignore[arg-type]
        return StaticStep(self, cache)  # type: ignore[arg-type]

    def pool_step(
        self, keys: Sequence[Tensor], values: Sequence[Tensor], *, compile: bool = False
    ) -> PoolStep:
        """Decode steps of rows at positions of their own, their keys and values in per-layer
        pools of slots (a paged cache; :class:`~dikkat.models.static_step.PoolStep`);
        ``compile=True``: compiled ahead of time and kept on disk on the CPU
        (:class:`~dikkat.models.aot_step.AotPoolStep`), else (or where that cannot be built) by
        ``torch.compile`` (:func:`~dikkat.models.aot_step.compiled_pool_step`)."""
        if compile:
            return compiled_pool_step(self, keys, values)  # type: ignore[arg-type]
        return PoolStep(self, keys, values)  # type: ignore[arg-type]

    @property
    def n_params(self) -> int:
        """Parameters, counting a tied embedding once, and the weights an inference copy holds
        in another format (packed, int8, bf16: they are no parameters)."""
        total = sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]
        for name, m in self.named_modules():  # type: ignore[attr-defined]
            w = getattr(m, "weight", None)
            owned = not isinstance(m, LinearRows) and not self.is_tied(f"{name}.weight")
            if isinstance(w, HeldWeight) and owned:  # LinearRows: views of another layer's rows
                total += math.prod(w.shape)
        return total

    def forward_inputs(
        self,
        ids: Tensor,
        mask: Mask | Tensor | None,
        valid: Tensor | None,
        offset: int,
        positions: Tensor | None,
        cache: Sequence[object] | None,
    ) -> tuple[Mask | Tensor, Tensor | None]:
        """What every decoder's forward checks and derives first: the ids against the vocabulary
        and the context, the cache's layer count, and, with ``valid`` (padding), the mask
        ``mask & padding(valid=valid)`` and each row's positions from its first real token.
        Returns (mask, positions); the mask defaults to ``causal()``."""
        layout = self.cache_layout()
        check_token_ids("ids", ids, self.config.vocab_size, device=self.tok_emb.weight.device)
        end = offset + ids.shape[1] if positions is None else int(positions.max()) + 1
        if end > layout.context:
            raise ValueError(
                f"positions reach {end - 1}, past the model's context of {layout.context}"
            )
        if cache is not None and len(cache) != layout.n_layers:
            raise ValueError(f"cache has {len(cache)} layers, the model {layout.n_layers}")
        mask = causal() if mask is None else mask
        if valid is not None:
            check_valid("valid", valid, ids)
            if offset != 0:
                raise ValueError(
                    f"valid describes ids alone, but offset={offset} puts cached keys before "
                    f"them: pass mask=causal() & padding(valid=<every slot>) and positions"
                )
            mask = as_mask(mask) & padding(valid=valid)
            positions = valid_positions(valid) if positions is None else positions
        return mask, positions

    def new_cache(
        self, batch: int, max_len: int | None = None, *, dtype: torch.dtype | None = None
    ) -> list[KVCache]:
        """One preallocated KV cache per layer, (B, G, max_len, D) each."""
        layout = self.cache_layout()
        max_len = layout.context if max_len is None else max_len
        check_int("max_len", max_len)
        if max_len > layout.context:
            raise ValueError(f"max_len={max_len} exceeds the model's context of {layout.context}")
        shape = (batch, layout.kv_heads, max_len, layout.head_dim)
        dtype = dtype or layout.dtype
        return [KVCache(*shape, dtype=dtype, device=layout.device) for _ in range(layout.n_layers)]

    @torch.no_grad()
    def generate(
        self,
        ids: Prompts,
        params: SamplingParams | int | None = None,
        *,
        weights: WeightFormat | None = None,
        **sampling: Unpack[Sampling],
    ) -> list[list[int]]:
        """Continue each prompt as ``params`` says (a :class:`~dikkat.generation.SamplingParams`,
        or an int ``max_new_tokens`` and the other fields as keywords: ``temperature=0.8,
        eos_id=2``), greedy by default.

        ``ids`` is a (B, T) tensor or a list of prompts of any lengths; either way the result is
        one list per prompt: the prompt, then its new tokens, cut after the first stop token.
        Uses a KV cache: one prefill pass, then one-token decode steps (see
        :func:`dikkat.generation.generate`), the linear layers multiplying in the format
        ``weights`` ("fp32", "bf16", "int8", "w8a8"; the parameters themselves stay as they are).
        """
        was_training = self.training
        self.eval()
        try:
            return generate(self, ids, params, weights=weights, **sampling)  # type: ignore[arg-type]
        finally:
            self.train(was_training)
