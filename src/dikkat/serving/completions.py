"""One completion request, from its checked fields to text pieces: the engine's tokens decoded
(:class:`~dikkat.text.stream.TextStream`), cut at a stop string, ended by the model's
end-of-text token (which is counted but not shown), and aborted when nobody reads it any more."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from dikkat.serving import SamplingParams
from dikkat.serving.protocol import CompletionRequest, stop_list
from dikkat.serving.runner import EngineRunner, Failure
from dikkat.text.stream import TextStream


class RequestError(ValueError):
    """A request the server refuses: the HTTP status, and the OpenAI ``param`` and ``code``."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class EngineFailedError(RuntimeError):
    """The engine's step raised while this request was running."""


@dataclass(frozen=True)
class Piece:
    text: str
    finish_reason: str | None  # "stop" | "length" on the last piece


def end_of_text_ids(tokenizer: Any) -> tuple[int, ...]:
    """The token that ends a text, if the tokenizer has one (GPT-2's ``<|endoftext|>``);
    dikkat's byte-level tokenizer has none."""
    token_to_id = getattr(getattr(tokenizer, "inner", None), "token_to_id", None)
    eos = token_to_id("<|endoftext|>") if token_to_id is not None else None
    return () if eos is None else (int(eos),)


def prompt_ids(request: CompletionRequest, tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt as token ids, refused (naming ``prompt``) when empty or outside the vocabulary."""
    if isinstance(request.prompt, str):
        ids = tokenizer.encode(request.prompt)
    else:
        ids = list(request.prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"prompt holds token ids outside the vocabulary of {vocab_size}: {bad[:5]}",
                param="prompt",
            )
    if not ids:
        raise RequestError("the prompt encodes to no tokens; give at least one", param="prompt")
    return ids


def sampling_params(
    request: CompletionRequest, prompt_len: int, max_len: int, stop_ids: Sequence[int]
) -> SamplingParams:
    """The engine's parameters for a request, once its sizes fit the model's context."""
    if request.n != 1:
        raise RequestError(f"n={request.n}: this server returns one choice (n=1)", param="n")
    if prompt_len >= max_len:
        raise RequestError(
            f"the prompt has {prompt_len} tokens; the model's context is {max_len} tokens, "
            f"so at most {max_len - 1} prompt tokens leave room for one new token",
            param="prompt",
            code="context_length_exceeded",
        )
    if prompt_len + request.max_tokens > max_len:
        raise RequestError(
            f"max_tokens={request.max_tokens} with a prompt of {_tokens(prompt_len)} needs "
            f"{prompt_len + request.max_tokens} positions, past the model's context of "
            f"{max_len}; at most {max_len - prompt_len} new tokens fit",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_new_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=None if request.top_p == 1.0 else request.top_p,
        seed=request.seed,
        stop_ids=tuple(stop_ids),
    )


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def stops_of(request: CompletionRequest) -> list[str]:
    try:
        return stop_list(request.stop)
    except ValueError as e:
        raise RequestError(str(e), param="stop") from None


class Completion:
    """A submitted request: iterate :meth:`pieces` once; :attr:`tokens` counts what it got."""

    def __init__(
        self,
        runner: EngineRunner,
        tokenizer: Any,
        prompt: list[int],
        params: SamplingParams,
        stops: Sequence[str],
    ) -> None:
        self.runner = runner
        self.prompt_tokens = len(prompt)
        self.tokens = 0  # tokens the engine generated for it, a stop token included
        self.stop_ids = frozenset(params.stop_ids)
        self.text = TextStream(tokenizer, stops)
        # raises ValueError or EngineFull, for the caller to answer
        self.request_id, self.queue = runner.submit(prompt, params)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The text as it comes; the last piece has a finish reason. Leaving the loop early (a
        client gone, a cancelled task) aborts the request, which frees its cache blocks."""
        finished = False
        try:
            while not finished:
                event = await self.queue.get()
                if isinstance(event, Failure):
                    finished = True  # the runner already aborted it
                    raise EngineFailedError(event.message)
                self.tokens += 1
                finish = event.finish_reason
                if finish == "stop" and event.token in self.stop_ids:
                    piece = ""  # the end-of-text token: counted, not shown
                else:
                    piece = self.text.push(event.token)
                if self.text.stopped:
                    finish = "stop"
                    self.runner.abort(self.request_id)  # frees its blocks now
                if finish is not None:
                    finished = True
                    self.runner.done(self.request_id)
                    piece += self.text.finish()
                yield Piece(piece, finish)
        finally:
            if not finished:
                self.runner.abort(self.request_id)
