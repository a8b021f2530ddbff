"""What goes into the engine and what comes out: sampling parameters, token events, statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from dikkat.generation.generate import check_sampling, check_seed
from dikkat.validate import check_int, is_int

FinishReason = Literal["stop", "length"]


class EngineFull(Exception):  # noqa: N818 (a state, like queue.Full, not an Error)
    """:meth:`~dikkat.serving.Engine.submit` found the waiting queue at ``max_queue`` (a server
    answers 429 or 503: try again later)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes: the arguments of :func:`dikkat.generation.generate` for it.

    A request's tokens are those of ``generate(model, [prompt], max_tokens, temperature=…,
    top_k=…, top_p=…, seed=…)`` for its prompt alone, whatever else runs beside it; a stop token
    ends it as ``eos_id`` ends ``generate`` (it is the last token, and it is sent).
    """

    max_tokens: int  # new tokens at most (≥ 1)
    temperature: float = 0.0  # 0 = greedy
    top_p: float | None = None  # nucleus sampling: the smallest set of tokens reaching top_p
    top_k: int | None = None  # sample among the k most likely tokens
    seed: int | None = None  # seeds this request's own generator; None: torch's global one
    stop_ids: tuple[int, ...] = ()  # token ids that end the request (finish_reason "stop")

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens)
        check_sampling(self.temperature, self.top_k, self.top_p)
        check_seed(self.seed)
        stop = self.stop_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Sequence):
            raise TypeError(f"stop_ids must be a tuple of int token ids, got {type(stop).__name__}")
        for i, token in enumerate(stop):
            if not is_int(token) or token < 0:
                raise ValueError(f"stop_ids[{i}] must be a token id (an int ≥ 0), got {token!r}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in stop))


@dataclass(frozen=True)
class TokenEvent:
    """One new token of one request; the request's last event carries why it ended."""

    request_id: int
    token: int
    finish_reason: FinishReason | None  # None while running


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (:meth:`~dikkat.serving.Engine.stats`).

    ``free_blocks`` counts the blocks a new sequence can take: free ones and *evictable* ones,
    cached prompt prefixes that no running sequence uses (kept for reuse until a block is needed).
    When nothing runs it equals ``total_blocks``. The token counts and the request counts
    (``finished``: ended by a stop token or ``max_tokens``; ``aborted``) are totals since the
    engine was built; ``prefix_hit_tokens`` counts prompt tokens whose keys and values were
    found in the cache instead of computed.
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
    prefix_hit_tokens: int
