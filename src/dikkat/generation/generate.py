"""Autoregressive generation with a preallocated KV cache: one prefill, then one-token decodes.

Notation: ``B`` batch, ``T`` prompt length (after left padding), ``V`` vocabulary.

Prompts of different lengths are left-padded to one length, so that every row's next token lands
in the same cache slot; a padding mask hides the pad slots and each row's positions start at 0 at
its first real token, so a padded row computes what it would alone.

The sampling loop (:func:`sample_loop`) knows nothing of the model: it takes a function that
gives the first logits and one that feeds a token and gives the next logits, so a decoder-only
model (prefill, then decode steps) and an encoder-decoder (encode once, then decoder steps over
self- and cross-attention caches, ``dikkat.models.Seq2Seq``) decode through the same loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor

from dikkat.core.masks import Mask, causal, padding
from dikkat.generation.prompts import Prompts, left_pad
from dikkat.layers.inference import inference_model
from dikkat.layers.inputs import check_token_id
from dikkat.layers.kv_cache import KVCache
from dikkat.layers.quantized import WeightFormat
from dikkat.validate import check_float, check_int


class LMConfig(Protocol):
    """The sizes generation checks its arguments against."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_len(self) -> int: ...


class CausalLM(Protocol):
    """What generation needs of a model (``dikkat.models.GPT`` is one)."""

    @property
    def config(self) -> LMConfig: ...

    def new_cache(self, batch: int, max_len: int | None = None) -> list[KVCache]: ...

    def __call__(
        self,
        ids: Tensor,
        mask: Mask | Tensor | None = None,
        *,
        valid: Tensor | None = None,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: list[KVCache] | None = None,
        last_only: bool = False,
    ) -> Tensor: ...


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Reject bad sampling arguments, also where greedy decoding (temperature 0) ignores them."""
    check_float("temperature", temperature, low=0.0)
    check_int("top_k", top_k, optional=True)
    check_float("top_p", top_p, low=0.0, high=1.0, low_open=True, optional=True)


def check_seed(seed: int | None) -> None:
    """None, or a seed ``torch.Generator.manual_seed`` takes as itself (it wraps negatives)."""
    check_int("seed", seed, at_least=0, at_most=2**64 - 1, optional=True)


def check_room(
    prompt_len: int, max_new_tokens: int, context: int, *, prompt: str = "the prompt"
) -> None:
    """The prompt and the new tokens fit in the model's context (a KV cache slot each).

    ``prompt`` names what comes before the new tokens in the errors (a Seq2Seq target starts
    with ``bos_id``).
    """
    tokens = f"{prompt_len} token" + ("" if prompt_len == 1 else "s")
    if prompt_len > context:
        raise ValueError(f"{prompt} has {tokens}, longer than the model's context of {context}")
    if prompt_len + max_new_tokens > context:
        room = context - prompt_len
        fit = f"at most {room} new tokens fit" if room else "no new token fits"
        raise ValueError(
            f"{prompt} has {tokens} and max_new_tokens={max_new_tokens}: "
            f"{prompt_len + max_new_tokens} positions, past the model's context of {context}; "
            f"{fit}"
        )


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
    return _sample(logits, temperature, top_k, top_p, generator)


def _sample(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """:func:`sample` on checked arguments (the decoding loop checks them once, not per token)."""
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


@torch.no_grad()
def prefill(
    model: CausalLM, ids: Tensor, cache: list[KVCache], valid: Tensor | None = None
) -> Tensor:
    """Run the prompts ids (B, T) through the model, filling the cache; last-slot logits (B, V).

    ``valid`` (B, ≥ T) is False at padding; its first T columns describe ``ids``.
    """
    T = ids.shape[1]
    logits = model(ids, valid=None if valid is None else valid[:, :T], cache=cache, last_only=True)
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
    mask, positions = causal(), None
    if valid is not None:  # the pads sit among the cached keys: the whole row's mask and count
        mask = mask & padding(valid=valid[:, : offset + 1])
        positions = (valid[:, : offset + 1].sum(-1, keepdim=True) - 1).clamp_min(0)  # (B, 1)
    logits = model(
        tokens.view(-1, 1),
        mask,
        offset=offset,
        positions=positions,
        cache=cache,
        last_only=True,
    )
    return logits[:, -1]


Step = Callable[[Tensor, int], Tensor]  # (token (B,), i) → logits (B, V) of the next token


def sample_loop(
    start: Callable[[], Tensor],
    step: Step,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
) -> Iterator[Tensor]:
    """The decoding loop of every model: yields the new tokens (B,), one step at a time.

    ``start()`` runs the model over what it is given (a prompt's prefill; or a source's encoding
    and the decoder's first step) and returns the logits (B, V) of the first new token;
    ``step(token, i)`` feeds the i-th new token (B,) (i from 0) and returns the logits of the
    next. A row that has produced ``eos_id`` keeps yielding ``eos_id``; the loop stops when
    every row has (checked once a step, only when ``eos_id`` is given) or after
    ``max_new_tokens``. ``seed`` seeds the sampling on the logits' device. The functions run
    whichever model they were built over: build them over an inference copy
    (:func:`~dikkat.layers.inference_model`) to decode in its weight format. The arguments are
    checked when it is called; the models' own checks (the vocabulary, the context) are the
    caller's.
    """
    check_int("max_new_tokens", max_new_tokens, at_least=0)
    check_sampling(temperature, top_k, top_p)
    check_int("eos_id", eos_id, at_least=0, optional=True)
    check_seed(seed)
    sampling = (temperature, top_k, top_p)
    return _loop(start, step, max_new_tokens, sampling, eos_id, seed)


def _loop(
    start: Callable[[], Tensor],
    step: Step,
    max_new_tokens: int,
    sampling: tuple[float, int | None, float | None],
    eos_id: int | None,
    seed: int | None,
) -> Iterator[Tensor]:
    if max_new_tokens == 0:
        return
    logits = start()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=logits.device).manual_seed(seed)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for i in range(max_new_tokens):
        token = _sample(logits, *sampling, generator)
        if eos_id is not None:
            token = token.masked_fill(done, eos_id)
            done |= token == eos_id
        yield token
        if i + 1 == max_new_tokens or (eos_id is not None and bool(done.all())):
            return
        logits = step(token, i)


def token_rows(tokens: Sequence[Tensor], batch: int, eos_id: int | None) -> list[list[int]]:
    """The tokens (B,) of each step → one list per row, cut after its first ``eos_id``."""
    if not tokens:
        return [[] for _ in range(batch)]
    rows = torch.stack(list(tokens), dim=1).tolist()  # (B, steps)
    if eos_id is None:
        return rows
    return [row[: row.index(eos_id) + 1] if eos_id in row else row for row in rows]


def iter_generate(
    model: CausalLM,
    prompts: Prompts,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    pad_id: int = 0,
    weights: WeightFormat | None = None,
) -> Iterator[Tensor]:
    """Yield the next token of every row, (B,), one step at a time (for streaming).

    A row that has produced ``eos_id`` keeps yielding ``eos_id``; generation stops when every row
    has, or after ``max_new_tokens``. ``weights`` is the format the linear layers multiply in
    while generating: "fp32" (the weights as they are), "bf16", "int8" (per-channel int8,
    weight-only), "w8a8" (int8 weights, 8-bit inputs; x86 CPUs), or None: the format of
    ``model`` if it is an inference copy already, else "fp32". Generation runs on an inference
    copy of the model made here (:func:`dikkat.layers.inference_model`; a copy given is used as
    it is): the model's own parameters are never changed, and changes to them after this call
    do not reach its tokens. The arguments are checked here, when it is called, not at the first
    ``next``.
    """
    c = model.config
    check_int("max_new_tokens", max_new_tokens, at_least=0)
    check_sampling(temperature, top_k, top_p)
    check_token_id("eos_id", eos_id, c.vocab_size, optional=True)
    check_seed(seed)
    ids, valid = left_pad(prompts, pad_id, vocab_size=c.vocab_size)
    B, T = ids.shape
    check_room(T, max_new_tokens, c.max_len)
    model = inference_model(model, weights)  # type: ignore[arg-type,assignment]
    device = next(iter(model.parameters())).device  # type: ignore[attr-defined]
    ids, valid = ids.to(device), valid.to(device)
    full_valid = None
    if not bool(valid.all()):
        # pad slots stay invalid; every generated slot is valid
        full_valid = torch.ones(B, T + max_new_tokens, dtype=torch.bool, device=device)
        full_valid[:, :T] = valid
    cache = model.new_cache(B, T + max_new_tokens) if max_new_tokens else []
    return sample_loop(
        lambda: prefill(model, ids, cache, full_valid),
        lambda token, i: decode_step(model, token, cache, T + i, full_valid),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        seed=seed,
    )


def generate(
    model: CausalLM,
    prompts: Prompts,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    pad_id: int = 0,
    weights: WeightFormat | None = None,
) -> list[list[int]]:
    """Each prompt followed by its new tokens, cut after ``eos_id``: one list per prompt, for a
    (B, T) tensor or a list of prompts alike. The arguments are those of :func:`iter_generate`.
    """
    tokens = list(
        iter_generate(
            model,
            prompts,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=eos_id,
            seed=seed,
            pad_id=pad_id,
            weights=weights,
        )
    )
    rows = token_rows(tokens, len(prompts), eos_id)
    return [_as_list(p) + row for p, row in zip(prompts, rows, strict=True)]


def _as_list(prompt: Sequence[int] | Tensor) -> list[int]:
    return prompt.tolist() if isinstance(prompt, Tensor) else list(prompt)
