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

import torch
from torch import Tensor
from typing_extensions import Unpack

from dikkat.core.masks import causal, padding
from dikkat.generation.constraint import Grammars, Guide, missing_grammars
from dikkat.generation.prompts import Prompts, left_pad
from dikkat.generation.protocol import DecoderLM
from dikkat.generation.sampler import Sampler, check_finite, draw, largest
from dikkat.generation.sampling import Sampling, SamplingParams, as_params
from dikkat.layers.kv_cache import KVCache
from dikkat.weights.formats import WeightFormat
from dikkat.weights.inference import inference_model


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
    """Next tokens (B,) from logits (B, V): greedy at temperature 0, else top-k / top-p sampling
    (the picks of :class:`~dikkat.generation.SamplingParams` without its penalties)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if params.greedy:
        return largest(logits)
    return draw(logits, temperature, top_k, top_p, generator)


@torch.no_grad()
def prefill(
    model: DecoderLM, ids: Tensor, cache: list[KVCache], valid: Tensor | None = None
) -> Tensor:
    """Run the prompts ids (B, T) through the model, filling the cache; last-slot logits (B, V).

    ``valid`` (B, ≥ T) is False at padding; its first T columns describe ``ids``.
    """
    T = ids.shape[1]
    logits = model(ids, valid=None if valid is None else valid[:, :T], cache=cache, last_only=True)
    return logits[:, -1]


@torch.no_grad()
def decode_step(
    model: DecoderLM,
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

TOKEN_LEVEL = ("stop", "logprobs", "top_logprobs", "prompt_logprobs")  # what the loop cannot do


def sample_loop(
    start: Callable[[], Tensor],
    step: Step,
    params: SamplingParams,
    prompt: Tensor | None = None,
    valid: Tensor | None = None,
    guide: Guide | None = None,
) -> Iterator[Tensor]:
    """The decoding loop of every model: yields the new tokens (B,), one step at a time.

    ``start()`` runs the model over what it is given (a prompt's prefill; or a source's encoding
    and the decoder's first step) and returns the logits (B, V) of the first new token;
    ``step(token, i)`` feeds the i-th new token (B,) (i from 0) and returns the logits of the
    next. The tokens are picked as ``params`` says (:class:`~dikkat.generation.Sampler`), from
    logits checked first: NaN or +inf in them raises
    :class:`~dikkat.generation.NonFiniteLogitsError` rather than pick a token from them; a
    row that has produced one of ``params.stop_ids`` keeps yielding it; the loop stops when
    every row has (checked once a step) or after ``params.max_new_tokens``. ``prompt`` (B, T)
    ids and ``valid`` (B, T), False at padding, are the tokens a repetition penalty counts as
    seen before the first pick (None: none). The functions run
    whichever model they were built over: build them over an inference copy
    (:func:`~dikkat.weights.inference_model`) to decode in its weight format. ``params.n`` is the
    caller's (each prompt a row per choice); the models' own checks (the vocabulary, the
    context) are the caller's too. ``guide`` holds the rows to ``params.constraint``
    (:meth:`Grammars.guide <dikkat.generation.constraint.Grammars.guide>`), which needs one.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.refuse("the decoding loop", *TOKEN_LEVEL)
    if params.constraint is not None and guide is None:
        raise missing_grammars(params.constraint, "grammars=")
    return _loop(start, step, params, Sampler(params, prompt, valid, guide))


def _loop(
    start: Callable[[], Tensor],
    step: Step,
    params: SamplingParams,
    sampler: Sampler,
) -> Iterator[Tensor]:
    if params.max_new_tokens == 0:
        return
    stops = params.stop_ids
    logits = start()
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    last = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    stop_ids = torch.tensor(stops, dtype=torch.long, device=logits.device) if stops else None
    for i in range(params.max_new_tokens):
        check_finite(logits, i)  # a sync, as the consumer of each token makes one anyway
        token = sampler.pick(logits)
        if stop_ids is not None:
            token = torch.where(done, last, token)  # a finished row repeats its stop token
            done |= torch.isin(token, stop_ids)
            last = token
        yield token
        if i + 1 == params.max_new_tokens or (stop_ids is not None and bool(done.all())):
            return
        logits = step(token, i)


def token_rows(tokens: Sequence[Tensor], batch: int, stop_ids: Sequence[int]) -> list[list[int]]:
    """The tokens (B,) of each step → one list per row, cut after its first stop token."""
    if not tokens:
        return [[] for _ in range(batch)]
    rows = torch.stack(list(tokens), dim=1).tolist()  # (B, steps)
    if not stop_ids:
        return rows
    stops = set(stop_ids)
    return [_cut(row, stops) for row in rows]


def _cut(row: list[int], stops: set[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in stops:
            return row[: i + 1]
    return row


def iter_generate(
    model: DecoderLM,
    prompts: Prompts,
    params: SamplingParams | int | None = None,
    *,
    pad_id: int = 0,
    weights: WeightFormat | None = None,
    compile: bool = False,
    grammars: Grammars | None = None,
    **sampling: Unpack[Sampling],
) -> Iterator[Tensor]:
    """Yield the next token of every row, (B · n,), one step at a time (for streaming).

    ``params`` says how to decode (:class:`~dikkat.generation.SamplingParams`); an int is
    ``max_new_tokens``, the other fields then come as keywords (``temperature=0.8, top_k=50,
    seed=0, eos_id=2``). With ``n > 1`` each prompt is decoded ``n`` times, rows
    ``p · n … p · n + n − 1``. A row that has produced a stop token keeps yielding it;
    generation stops when every row has, or after ``max_new_tokens``. ``weights`` is the format
    the linear layers multiply in while generating: "fp32" (the weights as they are), "bf16",
    "int8" (per-channel int8, weight-only), "w8a8" (int8 weights, 8-bit inputs; x86 CPUs), or
    None: the format of ``model`` if it is an inference copy already, else "fp32". Generation
    runs on an inference copy of the model made here (:func:`dikkat.weights.inference_model`; a
    copy given is used as it is): the model's own parameters are never changed, and changes to
    them after this call do not reach its tokens. ``compile=True`` decodes with the model's
    static, ``torch.compile``'d step (``model.static_step``, :class:`DecoderLM`'s; prompts of
    one length): the first step compiles, the later ones cost what they read.
    The compiled step belongs to the model object it decodes, so a plain model (copied here at
    each call) compiles at each call; pass ``inference_model(model)`` to compile once.
    ``grammars`` compiles ``params.constraint`` (``json_schema``, ``regex``, ``choice``,
    ``grammar``) against the tokenizer's vocabulary, which a constraint needs. The
    arguments are checked here, when it is called, not at the first ``next``.
    """
    params = as_params(params, sampling)
    params.refuse("iter_generate", *TOKEN_LEVEL)
    c = model.config
    params.check_vocab(c.vocab_size)
    ids, valid = left_pad(prompts, pad_id, vocab_size=c.vocab_size)
    if params.n > 1:
        ids, valid = ids.repeat_interleave(params.n, 0), valid.repeat_interleave(params.n, 0)
    B, T = ids.shape
    guide = None
    if params.constraint is not None and grammars is not None:
        guide = grammars.guide([params.constraint] * B)
    max_new = params.max_new_tokens
    check_room(T, max_new, c.max_len)
    model = inference_model(model, weights)  # type: ignore[arg-type,assignment]
    layout = model.cache_layout()
    ids, valid = ids.to(layout.device), valid.to(layout.device)
    full_valid = None
    if not bool(valid.all()):
        # pad slots stay invalid; every generated slot is valid
        full_valid = torch.ones(B, T + max_new, dtype=torch.bool, device=layout.device)
        full_valid[:, :T] = valid
    cache = model.new_cache(B, T + max_new) if max_new else []
    step: Step = lambda token, i: decode_step(model, token, cache, T + i, full_valid)  # noqa: E731
    if compile:
        if full_valid is not None:
            raise ValueError("compile=True needs no padding: prompts of one length")
        compiled = model.static_step(cache, compile=True) if max_new else None
        step = lambda token, i: compiled(token, T + i)  # noqa: E731
    start = lambda: prefill(model, ids, cache, full_valid)  # noqa: E731
    return sample_loop(start, step, params, ids, valid, guide)


def generate(
    model: DecoderLM,
    prompts: Prompts,
    params: SamplingParams | int | None = None,
    *,
    pad_id: int = 0,
    weights: WeightFormat | None = None,
    compile: bool = False,
    grammars: Grammars | None = None,
    **sampling: Unpack[Sampling],
) -> list[list[int]]:
    """Each prompt followed by its new tokens, cut after its first stop token: one list per
    prompt (``n`` per prompt with ``n > 1``, a prompt's choices together), for a (B, T)
    tensor or a list of prompts alike. The arguments are those of :func:`iter_generate`.

    >>> from dikkat.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=16, d_model=16, n_heads=2, n_layers=1, max_len=16))
    >>> generate(model.eval(), [[1, 2, 3]], SamplingParams(max_new_tokens=2)) == generate(
    ...     model, [[1, 2, 3]], 2
    ... )
    True
    """
    params = as_params(params, sampling)
    tokens = list(
        iter_generate(
            model, prompts, params, pad_id=pad_id, weights=weights, compile=compile,
            grammars=grammars,
        )
    )  # fmt: skip
    rows = token_rows(tokens, len(prompts) * params.n, params.stop_ids)
    starts = [_as_list(p) for p in prompts for _ in range(params.n)]
    return [p + row for p, row in zip(starts, rows, strict=True)]


def _as_list(prompt: Sequence[int] | Tensor) -> list[int]:
    return prompt.tolist() if isinstance(prompt, Tensor) else list(prompt)
