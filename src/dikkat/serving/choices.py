"""The choices of one request, from the engine's token events to text.

A request of P prompts and ``n`` choices is P·n engine requests, one per (prompt, choice), each
with the parameters of ``params.choices()`` (choice j seeded ``seed + j``); choice
``p·n + j`` is prompt p's choice j, the order OpenAI gives them. Each :class:`Choice` decodes
its tokens into text (:class:`~dikkat.text.stream.TextStream`: whole characters, cut at a stop
string), leaves out the end-of-text token that ends it (counted, not shown, not in the
log-probabilities), and is aborted when nobody reads it any more, which frees its cache blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from dikkat.generation import SamplingParams, TokenLogprob
from dikkat.serving.params import ChatIds
from dikkat.serving.protocol import RequestError
from dikkat.serving.requests import EngineFull
from dikkat.serving.runner import EngineRunner, Failure
from dikkat.serving.tokens import Vocabulary
from dikkat.text.stream import TextStream


class EngineFailedError(RuntimeError):
    """The engine's step raised while this request was running."""


@dataclass(frozen=True)
class Piece:
    """What one token event adds to a choice: text (possibly none), the log-probabilities of
    the tokens behind it (when asked), the prompt's (on the first piece, when asked), and on
    the last piece why it ended."""

    text: str
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass
class Result:
    """A choice once it ended."""

    index: int
    prompt: list[int]
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    tokens: int = 0  # the tokens generated, the end-of-text token included


class Choice:
    """One submitted (prompt, choice): iterate :meth:`pieces` once."""

    def __init__(
        self,
        runner: EngineRunner,
        vocab: Vocabulary,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        stops: Sequence[str],
    ) -> None:
        self.runner, self.index, self.prompt = runner, index, prompt
        self.tokens = 0  # tokens the engine generated for it, a stop token included
        self.stop_ids = frozenset(params.stop_ids)
        self.text = TextStream(vocab, stops)
        # raises ValueError or EngineFull, for the caller to answer
        self.request_id, self.queue = runner.submit(prompt, params)
        self.finished = False

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.runner.abort(self.request_id)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The text as it comes; the last piece has a finish reason. Leaving the loop early (a
        client gone, a cancelled task) aborts the request."""
        try:
            while not self.finished:
                event = await self.queue.get()
                if isinstance(event, Failure):
                    self.finished = True  # it is over: the engine ended it (or dropped all)
                    raise EngineFailedError(event.message)
                yield self._piece(event)
        finally:
            self.abort()

    def _piece(self, event: Any) -> Piece:
        finish, text, logprobs = event.finish_reason, "", ()
        if event.token is not None:  # None: max_tokens = 0, the prompt's log-probabilities only
            self.tokens += 1
            if not (finish == "stop" and event.token in self.stop_ids):  # end of text: not shown
                text = self.text.push(event.token)
            # listed even when not shown: a scorer counts one entry per generated token
            logprobs = () if event.logprob is None else (event.logprob,)
        if self.text.stopped:
            finish = "stop"
            if not self.finished:
                self.finished = True
                self.runner.finish(self.request_id)  # frees its blocks now
        if finish is not None:
            self.finished = True
            self.runner.done(self.request_id)
            text += self.text.finish()
        return Piece(text, finish, logprobs, event.prompt_logprobs)


class Choices:
    """Every choice of a request, submitted at once (all or none: a full queue aborts the ones
    already queued and raises :class:`EngineFull`)."""

    def __init__(
        self,
        runner: EngineRunner,
        vocab: Vocabulary,
        prompts: Sequence[tuple[list[int], SamplingParams]],
        stops: Sequence[str],
    ) -> None:
        self.prompt_tokens = sum(len(p) for p, _ in prompts)
        self.choices: list[Choice] = []
        try:
            for prompt, params in prompts:
                for choice in params.choices():
                    index = len(self.choices)
                    self.choices.append(Choice(runner, vocab, index, prompt, choice, stops))
        except (EngineFull, ValueError):
            self.abort()
            raise

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def abort(self) -> None:
        for choice in self.choices:
            choice.abort()

    async def whole(self) -> list[Result]:
        """Every choice to its end (raises :class:`EngineFailedError`)."""
        tasks = [asyncio.ensure_future(_collect(c)) for c in self.choices]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # a failed or cancelled choice ends them all
            for task in tasks:
                task.cancel()
            self.abort()

    async def stream(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice index, piece) as each choice's pieces come, interleaved."""
        merged: asyncio.Queue = asyncio.Queue()

        async def feed(choice: Choice) -> None:
            try:
                async for piece in choice.pieces():
                    await merged.put((choice.index, piece))
            except EngineFailedError as e:
                await merged.put(e)

        tasks = [asyncio.ensure_future(feed(c)) for c in self.choices]
        try:
            left = len(self.choices)
            while left:
                item = await merged.get()
                if isinstance(item, EngineFailedError):
                    raise item
                left -= item[1].finish_reason is not None
                yield item
        finally:
            for task in tasks:
                task.cancel()
            self.abort()


async def _collect(choice: Choice) -> Result:
    result = Result(choice.index, choice.prompt)
    async for piece in choice.pieces():
        result.text += piece.text
        result.logprobs += piece.logprobs
        if piece.prompt_logprobs is not None:
            result.prompt_logprobs = piece.prompt_logprobs
        result.finish_reason = piece.finish_reason
    result.tokens = choice.tokens
    return result


async def until_disconnected(receive: Any) -> None:
    """Returns when the client closes the connection (the body is already read, so the next
    ASGI message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Any, receive: Any) -> Any:
    """``work``'s result, or None when the client left first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(receive))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError, EngineFailedError):
        await task
    return None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class Served:
    """What every route needs of the app: the engine's runner, the tokenizer, the model's name,
    context and chat template, and how many requests may wait (None: no limit known)."""

    runner: EngineRunner
    vocab: Vocabulary
    name: str
    max_len: int
    max_queue: int | None
    chat_ids: ChatIds | None  # messages → prompt ids; None: no chat template
    grammars: Any  # compiles requests' constraints (dikkat.serving.structured.ServedGrammars)
    knows_tools: bool = False  # the chat template renders tools itself (dikkat.serving.tools)
    thinks: bool = False  # the model thinks in <think> tags (dikkat.serving.reasoning)

    def check_count(self, count: int, param: str, what: str) -> None:
        """Refuse a request of more choices than the engine's queue holds at all."""
        if self.max_queue is not None and count > self.max_queue:
            raise RequestError(
                f"{what} is {count} choices; this server queues at most {self.max_queue} "
                "requests at once (dikkat serve --max-queue)",
                param=param,
            )
