"""``POST /v1/completions``: continue prompts, whole or streamed (docs/server.md).

The prompt is a string, a list of strings, a list of token ids or a list of lists of ids; each
prompt gets ``n`` choices (``best_of`` of them generated, the ``n`` with the highest mean
log-probability per token kept). ``echo`` puts the prompt before its completion, and with
``logprobs`` the prompt's tokens and their log-probabilities before the completion's, so that
``max_tokens: 0, echo: true, logprobs: 1`` scores a text (what lm-evaluation-harness's
``local-completions`` sends, with ``max_tokens: 1``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from dikkat.serving.choices import Choices, EngineFailedError, Result, Served, sse, usage
from dikkat.serving.logprobs import CompletionLogprobs
from dikkat.serving.params import completion_prompts, room, stops_of
from dikkat.serving.protocol import CompletionRequest, RequestError, error_body, refusal


class Completion:
    """A checked completions request, its prompts tokenised (CPU work: the server makes it on a
    worker thread); :meth:`submit` it on the event loop, then :meth:`whole` or :meth:`events`,
    once."""

    def __init__(self, body: CompletionRequest, served: Served) -> None:
        refused = refusal(body)
        if refused is not None:
            raise RequestError(refused[1], param=refused[0])
        self.body, self.served, vocab = body, served, served.vocab
        self.prompts = completion_prompts(body, vocab, served.max_len)
        self.n = body.n
        self.best_of = body.best_of or body.n
        self.top = body.logprobs  # None: no log-probabilities
        count, many = len(self.prompts) * self.best_of, len(self.prompts) > 1
        what = f"{len(self.prompts)} prompts × {self.best_of}" if many else f"n={self.best_of}"
        served.check_count(count, "prompt" if many else "n", what)
        stops = stops_of(body)
        for i, prompt in enumerate(self.prompts):
            where = "the prompt" if len(self.prompts) == 1 else f"prompt[{i}]"
            room(len(prompt), body.max_tokens, served.max_len, "max_tokens", where)
        params = body.to_sampling_params(vocab.eos_ids, vocab.vocab_size)  # every prompt's
        served.grammars.check(params, body.constraint()[1])
        self.jobs, self.stops = [(prompt, params) for prompt in self.prompts], stops
        self.prompt_texts = [vocab.decode(p) for p in self.prompts]
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def submit(self) -> None:
        """Hand the choices to the engine (raises ``EngineFull`` or the engine's ``ValueError``);
        on the event loop, where the runner registers each request's queue."""
        self.choices = Choices(self.served.runner, self.served.vocab, self.jobs, self.stops)

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.served.name,
            "choices": choices,
        }

    def _usage(self) -> dict[str, int]:
        return usage(self.choices.prompt_tokens, self.choices.completion_tokens)

    def abort(self) -> None:
        self.choices.abort()

    async def whole(self) -> dict[str, Any]:
        """The answer, once every choice has ended (raises :class:`EngineFailedError`)."""
        results = await self.choices.whole()
        kept = []
        for p in range(len(self.prompts)):
            group = results[p * self.best_of : (p + 1) * self.best_of]
            if self.best_of > self.n:  # OpenAI: "the highest log probability per token"
                group = sorted(group, key=_mean_logprob, reverse=True)[: self.n]
            kept += [(p * self.n + j, p, r) for j, r in enumerate(group)]
        body = self._object([self._choice(i, p, r) for i, p, r in kept])
        body["usage"] = self._usage()
        return body

    def _choice(self, index: int, p: int, result: Result) -> dict[str, Any]:
        prompt_text = self.prompt_texts[p]
        text = prompt_text + result.text if self.body.echo else result.text
        logprobs = None
        if self.top is not None:
            parts = []
            if self.body.echo:
                parts.append(self._prompt_part(p, result.prompt_logprobs))
            lp = CompletionLogprobs(self.served.vocab, self.top, len(prompt_text))
            parts.append(lp.part(result.logprobs, [e.token for e in result.logprobs]))
            logprobs = CompletionLogprobs.join(parts)
        finish = result.finish_reason
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _prompt_part(self, p: int, entries: Any) -> dict[str, Any]:
        prompt = self.prompts[p]
        if entries is None:  # not asked for: the tokens, without numbers
            entries = (None,) * len(prompt)
        return CompletionLogprobs(self.served.vocab, self.top or 0).part(entries, prompt)

    async def events(self) -> AsyncIterator[str]:
        """``data: {chunk}`` per piece of a choice's text (the first of a choice with ``echo``
        holds the prompt), the last of a choice with its finish reason; with ``include_usage``
        every chunk has ``"usage": null`` and one more chunk (no choices) carries the counts;
        then ``data: [DONE]``."""
        include_usage = self.body.include_usage
        trackers: dict[int, CompletionLogprobs] = {}
        try:
            async for index, piece in self.choices.stream():
                p = index // self.best_of
                text, logprobs, first = piece.text, None, index not in trackers
                if first:
                    start = len(self.prompt_texts[p])
                    trackers[index] = CompletionLogprobs(self.served.vocab, self.top or 0, start)
                    if self.body.echo:
                        text = self.prompt_texts[p] + text
                if self.top is not None:
                    tokens = [e.token for e in piece.logprobs]
                    parts = [trackers[index].part(piece.logprobs, tokens)]
                    if first and self.body.echo:
                        parts.insert(0, self._prompt_part(p, piece.prompt_logprobs))
                    logprobs = CompletionLogprobs.join(parts)
                if not text and piece.finish_reason is None and not (logprobs or {}).get("tokens"):
                    continue
                finish = piece.finish_reason
                chunk = self._object(
                    [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
                )
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        except EngineFailedError as e:
            yield sse(error_body(f"the engine failed: {e}", "server_error"))
            return
        if include_usage:
            last = self._object([])
            last["usage"] = self._usage()
            yield sse(last)
        yield "data: [DONE]\n\n"


def _mean_logprob(result: Result) -> float:
    return sum(e.logprob for e in result.logprobs) / max(len(result.logprobs), 1)
