"""``POST /v1/chat/completions``: the assistant's answer to a conversation (docs/server.md).

The messages are rendered in the model's chat template (a model without one is refused with
400, ``code: "chat_template_missing"``) and the answer ends at any of the tokenizer's
end-of-generation ids (EOS, the end-of-turn token), which is not shown. Without ``max_tokens``
(or ``max_completion_tokens``) an answer may run to the end of the model's context.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from dikkat.serving.choices import Choices, EngineFailedError, Piece, Result, Served, sse, usage
from dikkat.serving.logprobs import chat_logprobs
from dikkat.serving.params import chat_max_tokens, check_ids, conversation_ids, room, stops_of
from dikkat.serving.protocol import ChatRequest, RequestError, error_body, refusal


class ChatCompletion:
    """A checked chat request, its conversation rendered and tokenised (CPU work: the server
    makes it on a worker thread); :meth:`submit` it on the event loop, then :meth:`whole` or
    :meth:`events`, once."""

    def __init__(self, body: ChatRequest, served: Served) -> None:
        refused = refusal(body)
        if refused is not None:
            raise RequestError(refused[1], param=refused[0])
        self.body, self.served = body, served
        prompt = conversation_ids(
            body.messages, served.chat_ids, served.vocab, served.max_len, served.name
        )
        check_ids(prompt, served.vocab.vocab_size, "the rendered conversation", "messages")
        served.check_count(body.n, "n", f"n={body.n}")
        limit, param = chat_max_tokens(body)
        new = room(len(prompt), limit, served.max_len, param, "the conversation")
        self.top = body.top_logprobs or 0
        params = body.to_sampling_params(new, served.vocab.eos_ids, served.vocab.vocab_size)
        served.grammars.check(params, body.constraint()[1])
        self.job, self.stops = (prompt, params), stops_of(body)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def submit(self) -> None:
        """Hand the choices to the engine (raises ``EngineFull`` or the engine's ``ValueError``);
        on the event loop, where the runner registers each request's queue."""
        self.choices = Choices(self.served.runner, self.served.vocab, [self.job], self.stops)

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.served.name,
            "system_fingerprint": None,
            "choices": choices,
        }

    def _usage(self) -> dict[str, int]:
        return usage(self.choices.prompt_tokens, self.choices.completion_tokens)

    def _logprobs(self, entries: Any) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.served.vocab, entries, self.top)

    def abort(self) -> None:
        self.choices.abort()

    async def whole(self) -> dict[str, Any]:
        """The answer, once every choice has ended (raises :class:`EngineFailedError`)."""
        results = await self.choices.whole()
        body = self._object("chat.completion", [self._choice(r) for r in results])
        body["usage"] = self._usage()
        return body

    def _choice(self, result: Result) -> dict[str, Any]:
        message = {"role": "assistant", "content": result.text, "refusal": None}
        return {
            "index": result.index,
            "message": message,
            "logprobs": self._logprobs(result.logprobs),
            "finish_reason": result.finish_reason,
        }

    async def events(self) -> AsyncIterator[str]:
        """``chat.completion.chunk`` events: a choice's first says the role, the next carry its
        text as it comes, the last its finish reason; ``include_usage`` as for completions."""
        include_usage = self.body.include_usage
        started: set[int] = set()
        try:
            async for index, piece in self.choices.stream():
                if index not in started:
                    started.add(index)
                    yield self._chunk(index, {"role": "assistant", "content": ""}, None, None)
                if not piece.text and piece.finish_reason is None and not piece.logprobs:
                    continue
                delta = {"content": piece.text} if piece.text else {}
                yield self._chunk(index, delta, piece, self._logprobs(piece.logprobs))
        except EngineFailedError as e:
            yield sse(error_body(f"the engine failed: {e}", "server_error"))
            return
        if include_usage:
            last = self._object("chat.completion.chunk", [])
            last["usage"] = self._usage()
            yield sse(last)
        yield "data: [DONE]\n\n"

    def _chunk(self, index: int, delta: dict[str, Any], piece: Piece | None, logprobs: Any) -> str:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": None if piece is None else piece.finish_reason,
        }
        chunk = self._object("chat.completion.chunk", [choice])
        if self.body.include_usage:
            chunk["usage"] = None
        return sse(chunk)
