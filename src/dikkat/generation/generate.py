"""Autoregressive generation with a preallocated KV cache: one prefill, then one-token decodes.

Notation: ``B`` batch, ``T`` prompt length (after left padding), ``V`` vocabulary.

Prompts of different lengths are left-padded to one length, so that every row's next token lands
in the same cache slot; a padding mask hides the pad slots and each row's positions start at 0 at
its first real token, so a padded row computes what it would alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor

from dikkat.core.masks import Mask, causal, padding
from dikkat.generation.kv_cache import KVCache
from dikkat.layers.linear import packed_for_inference


class CausalLM(Protocol):
    """What generation needs of a model (``dikkat.models.GPT`` is one)."""

    def new_cache(self, batch: int, max_len: int | None = None) -> list[KVCache]: ...

    def __call__(
        self,
        ids: Tensor,
        mask: Mask | Tensor | None = None,
        *,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: list[KVCache] | None = None,
        last_only: bool = False,
    ) -> Tensor: ...


def left_pad(prompts: Sequence[Sequence[int]] | Tensor, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Prompts → ids (B, T) left-padded with ``pad_id`` and ``valid`` (B, T) (False = padding)."""
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2 or prompts.dtype.is_floating_point:
            raise ValueError(
                f"prompt ids must be an integer tensor (B, T), got {tuple(prompts.shape)}"
            )
        if prompts.numel() == 0:
            raise ValueError(f"every prompt needs at least one token, got {tuple(prompts.shape)}")
        return prompts, torch.ones_like(prompts, dtype=torch.bool)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        valid[b, T - len(p) :] = True
    return ids, valid


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Reject bad sampling arguments, also where greedy decoding (temperature 0) ignores them."""
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next tokens (B,) from logits (B, V): greedy at temperature 0, else top-k / top-p sampling."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _step_mask(valid: Tensor | None, length: int) -> Mask:
    return causal() if valid is None else causal() & padding(valid=valid[:, :length])


@torch.no_grad()
def prefill(
    model: CausalLM, ids: Tensor, cache: list[KVCache], valid: Tensor | None = None
) -> Tensor:
    """Run the prompts ids (B, T) through the model, filling the cache; last-slot logits (B, V)."""
    T = ids.shape[1]
    positions = None if valid is None else (valid[:, :T].long().cumsum(-1) - 1).clamp_min(0)
    logits = model(ids, _step_mask(valid, T), cache=cache, positions=positions, last_only=True)
    return logits[:, -1]


@torch.no_grad()
def decode_step(
    model: CausalLM,
    tokens: Tensor,
    cache: list[KVCache],
    offset: int,
    valid: Tensor | None = None,
) -> Tensor:
    """One new token per row (B,) at cache slot ``offset``; returns its logits (B, V)."""
    positions = None
    if valid is not None:
        positions = (valid[:, : offset + 1].sum(-1, keepdim=True) - 1).clamp_min(0)  # (B, 1)
    logits = model(
        tokens.view(-1, 1),
        _step_mask(valid, offset + 1),
        offset=offset,
        positions=positions,
        cache=cache,
        last_only=True,
    )
    return logits[:, -1]


def iter_generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]] | Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    pad_id: int = 0,
) -> Iterator[Tensor]:
    """Yield the next token of every row, (B,), one step at a time (for streaming).

    A row that has produced ``eos_id`` keeps yielding ``eos_id``; generation stops when every row
    has, or after ``max_new_tokens``.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
    ids, valid = left_pad(prompts, pad_id)
    B, T = ids.shape
    device = next(iter(model.parameters())).device  # type: ignore[attr-defined]
    ids, valid = ids.to(device), valid.to(device)
    full_valid = None
    if not bool(valid.all()):
        # pad slots stay invalid; every generated slot is valid
        full_valid = torch.ones(B, T + max_new_tokens, dtype=torch.bool, device=device)
        full_valid[:, :T] = valid
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if max_new_tokens == 0:
        return
    cache = model.new_cache(B, T + max_new_tokens)
    with packed_for_inference(model):  # oneDNN-packed weights: decoding reads them faster
        logits = prefill(model, ids, cache, full_valid)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            token = sample(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )
            if eos_id is not None:
                token = token.masked_fill(done, eos_id)
                done |= token == eos_id
            yield token
            if step + 1 == max_new_tokens or bool(done.all()):
                return
            logits = decode_step(model, token, cache, T + step, full_valid)


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]] | Tensor,
    max_new_tokens: int,
    **kwargs: object,
) -> list[list[int]]:
    """The generated tokens of each prompt (without the prompt), cut after ``eos_id``."""
    steps = list(iter_generate(model, prompts, max_new_tokens, **kwargs))  # type: ignore[arg-type]
    if not steps:
        return [[] for _ in range(len(prompts))]
    out = torch.stack(steps, dim=1).tolist()  # (B, steps)
    eos_id = kwargs.get("eos_id")
    if eos_id is not None:
        out = [row[: row.index(eos_id) + 1] if eos_id in row else row for row in out]
    return out
