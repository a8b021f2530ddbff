"""What goes into the engine and what comes out: sampling parameters (the one
:class:`~dikkat.generation.SamplingParams` of every entry point) and what a request must be to
enter an engine, token events, statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dikkat.generation.sampler import Sampler, TokenLogprob
from dikkat.generation.sampling import SamplingParams
from dikkat.validate import is_int
from dikkat.weights import InferenceLinear

__all__ = ["EngineFull", "EngineStats", "FinishReason", "SamplingParams", "TokenEvent"]

FinishReason = Literal["stop", "length", "error"]


class EngineFull(Exception):  # noqa: N818 (a state, like queue.Full, not an Error)
    """:meth:`~dikkat.serving.Engine.submit` found the waiting queue at ``max_queue`` (a server
    answers 429 or 503: try again later)."""


@dataclass(frozen=True)
class TokenEvent:
    """One new token of one request; the request's last event carries why it ended.

    ``token`` is None in the one event of a request with ``max_new_tokens = 0`` (which asks
    for its prompt's log-probabilities alone) and in the last event of a request that failed:
    ``finish_reason`` "error", and ``error`` says why (the model raised on it, or its output was
    not finite; the other requests go on). ``logprob`` is the token's
    :class:`~dikkat.generation.TokenLogprob` when the request asked for ``logprobs``;
    ``prompt_logprobs``, on a request's first event when it asked for them, holds one entry per
    prompt token, None for the first (nothing comes before it).
    """

    request_id: int
    token: int | None
    finish_reason: FinishReason | None  # None while running
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    error: str | None = None  # with finish_reason "error": one line


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (:meth:`~dikkat.serving.Engine.stats`).

    ``free_blocks`` counts the blocks a new sequence can take: free ones and *evictable* ones,
    cached prompt prefixes that no running sequence uses (kept for reuse until a block is needed).
    When nothing runs it equals ``total_blocks``. The token counts and the request counts
    (``finished``: ended by a stop token, by ``max_new_tokens`` or by
    :meth:`~dikkat.serving.Engine.finish`, a stop string; ``aborted``; ``failed``: ended alone by
    an error of its own, docs/engine.md) are totals since the engine was built;
    ``prefix_hit_tokens`` counts prompt tokens whose keys and values were found in the cache
    instead of computed.
    """

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    block_size: int
    prompt_tokens: int
    generated_tokens: int
    finished: int
    aborted: int
    failed: int
    prefix_hit_tokens: int
    preempted: int


@dataclass(eq=False)
class EngineSequence:
    """One request inside the engine: its tokens, its sampler, its block table."""

    id: int
    tokens: list[int]  # the prompt, then the tokens generated so far
    prompt_len: int
    params: SamplingParams
    sampler: Sampler
    blocks: list[int] = field(default_factory=list)  # block table
    cached: int = 0  # tokens whose keys and values are in the blocks
    finish: FinishReason | None = None
    aborted: bool = False
    matcher: Any = None  # holds the text to params.constraint (dikkat.generation.constraint)

    def fail(self, message: str) -> TokenEvent:
        """End the request with an error (its blocks are given back when the step ends)."""
        self.finish = "error"
        return TokenEvent(self.id, None, "error", error=message)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def fed(self) -> int:
        """The tokens a prefill writes: the prompt; for a request preempted after it made
        tokens, every token but its last (which the next decode step feeds)."""
        return len(self.tokens) - 1 if self.generated else self.prompt_len

    @property
    def slots(self) -> int:
        """Cache slots the request needs in all: its last token is never fed back."""
        return self.prompt_len + max(self.params.max_new_tokens, 1) - 1


def batched_layouts(model: object, max_batch: int) -> bool | None:
    """The batched weight layouts for batches of more than two, on a model that is not an
    inference copy yet (a copy keeps its own)."""
    if any(isinstance(m, InferenceLinear) for m in model.modules()):  # type: ignore[attr-defined]
        return None
    return max_batch > 2


def vocab_rows(model: object, vocab_size: int) -> int:
    """The ids ``model`` can embed: ``vocab_size`` (its config's), or the rows of its token
    embedding (``tok_emb``, an ``nn.Embedding`` or a packed one) when they are fewer (a GGUF
    header may claim more ids than its embedding holds)."""
    rows = getattr(getattr(model, "tok_emb", None), "num_embeddings", None)
    return min(vocab_size, rows) if is_int(rows) else vocab_size


def describe(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def check_prompt(prompt: object, vocab_size: int) -> list[int]:
    """A request's prompt as a list of int ids, each in the vocabulary of ``vocab_size``; a
    TypeError or ValueError names what is wrong."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be a list of int token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("prompt is empty: a request needs at least one token")
    for i, token in enumerate(prompt):
        if not is_int(token):
            raise TypeError(f"prompt[{i}] is {token!r} ({type(token).__name__}), not an int")
        if not 0 <= token < vocab_size:
            raise ValueError(f"prompt[{i}] is {token}, outside the vocabulary of {vocab_size}")
    return [int(t) for t in prompt]


def check_request(
    prompt: object,
    params: object,
    vocab_size: int,
    max_len: int,
    block_size: int,
    num_blocks: int,
) -> list[int]:
    """What :meth:`~dikkat.serving.Engine.submit` takes: ``prompt`` (:func:`check_prompt`) and
    ``params``, a :class:`SamplingParams` (its own values checked when it was made) that one
    request of token ids can honour, whose ids are in the vocabulary of ``vocab_size``, and
    whose whole length fits the model's context ``max_len`` and the engine's pool of
    ``num_blocks`` blocks of ``block_size`` slots. Returns the prompt as a list of ids; a
    TypeError or ValueError names what is wrong."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.refuse("the engine", "n", "stop")
    tokens = check_prompt(prompt, vocab_size)
    params.check_vocab(vocab_size)
    n, m = len(tokens), params.max_new_tokens
    if n + m > max_len:
        raise ValueError(
            f"the prompt has {n} tokens and max_new_tokens={m}: {n + m} positions, past the "
            f"model's context of {max_len}"
        )
    need = -(-(n + max(m, 1) - 1) // block_size)
    if need > num_blocks:
        raise ValueError(
            f"the prompt ({n} tokens) and max_new_tokens={m} need {need} blocks of {block_size} "
            f"slots, more than the engine's num_blocks={num_blocks}"
        )
    return tokens
