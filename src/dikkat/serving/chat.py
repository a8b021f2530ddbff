"""``POST /v1/chat/completions``: the assistant's answer to a conversation (docs/server.md).

The messages are rendered in the model's chat template (a model without one is refused with
400, ``code: "chat_template_missing"``) and the answer ends at any of the tokenizer's
end-of-generation ids (EOS, the end-of-turn token), which is not shown. Without ``max_tokens``
(or ``max_completion_tokens``) an answer may run to the end of the model's context.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from dikkat.serving import reasoning, tools
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
        self.tools = [t.function.name for t in body.tools or []] if tools.active(body) else []
        knows = served.knows_tools
        template = dict(body.chat_template_kwargs or {})
        if knows and self.tools:
            template["tools"] = [t.model_dump(exclude_none=True) for t in body.tools or []]
        prompt = conversation_ids(
            body.messages, served.chat_ids, served.vocab, served.max_len, served.name,
            lambda messages: tools.conversation(messages, body, knows), **template,
        )  # fmt: skip
        # a model that thinks in <think> tags, and whether the prompt opened one already
        self.thinks = served.thinks
        tail = served.vocab.decode_all(prompt[-4:]) if self.thinks else ""
        self.opened = tail.rstrip().endswith(reasoning.OPEN)
        check_ids(prompt, served.vocab.vocab_size, "the rendered conversation", "messages")
        served.check_count(body.n, "n", f"n={body.n}")
        limit, param = chat_max_tokens(body)
        new = room(len(prompt), limit, served.max_len, param, "the conversation")
        self.top = body.top_logprobs or 0
        params = body.to_sampling_params(new, served.vocab.eos_ids, served.vocab.vocab_size)
        held, field = tools.tool_constraint(body), body.constraint()[1]
        if held is not None:  # (refusal() let no other constraint through beside it)
            try:
                params, field = dataclasses.replace(params, **{held.kind: held.value}), "tools"
            except ValueError as e:  # min_tokens, which a call may not leave room for
                raise RequestError(f"tools: {e}", param="tools") from None
        served.grammars.check(params, field)
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
        message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
        finish = result.finish_reason
        if self.thinks:
            message["reasoning_content"], message["content"] = reasoning.split(
                result.text, self.opened
            )
        if self.tools:
            message["content"], calls = tools.tool_calls(message["content"], self.tools)
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {
            "index": result.index,
            "message": message,
            "logprobs": self._logprobs(result.logprobs),
            "finish_reason": finish,
        }

    async def events(self) -> AsyncIterator[str]:
        """``chat.completion.chunk`` events: a choice's first says the role, the next carry its
        text as it comes (its thinking as ``reasoning_content``, for a model that thinks; with
        tools, its answer whole once it ends), the last its finish reason; ``include_usage``
        as for completions."""
        include_usage = self.body.include_usage
        started: set[int] = set()
        held: dict[int, list[str]] = {}  # with tools: each choice's answer, until it ends
        tokens: dict[int, list[Any]] = {}  # and its tokens' log-probabilities
        splitters: dict[int, reasoning.Splitter] = {}
        try:
            async for index, piece in self.choices.stream():
                if index not in started:
                    started.add(index)
                    yield self._chunk(index, {"role": "assistant", "content": ""}, None, None)
                if not self.thinks and not self.tools:  # each piece as it comes
                    if piece.text or piece.finish_reason is not None or piece.logprobs:
                        delta = {"content": piece.text} if piece.text else {}
                        yield self._chunk(index, delta, piece, self._logprobs(piece.logprobs))
                    continue
                parts = [("content", piece.text)]
                if self.thinks:
                    splitter = splitters.setdefault(index, reasoning.Splitter(self.opened))
                    parts = splitter.push(piece.text)
                    parts += splitter.finish() if piece.finish_reason is not None else []
                for kind, text in parts:
                    if kind == "reasoning":
                        yield self._chunk(index, {"reasoning_content": text}, None, None)
                    elif self.tools:
                        held.setdefault(index, []).append(text)
                    elif text:
                        yield self._chunk(index, {"content": text}, None, None)
                if self.tools:
                    tokens.setdefault(index, []).extend(piece.logprobs)
                    if piece.finish_reason is not None:
                        text, lps = "".join(held.pop(index, [])), tokens.pop(index)
                        for chunk in self._tool_chunks(index, text, piece, lps):
                            yield chunk
                elif piece.finish_reason is not None or piece.logprobs:
                    yield self._chunk(index, {}, piece, self._logprobs(piece.logprobs))
        except EngineFailedError as e:
            yield sse(error_body(f"the engine failed: {e}", "server_error"))
            return
        if include_usage:
            last = self._object("chat.completion.chunk", [])
            last["usage"] = self._usage()
            yield sse(last)
        yield "data: [DONE]\n\n"

    def _tool_chunks(self, index: int, text: str, last: Piece, logprobs: list[Any]) -> list[str]:
        """A choice's answer with tools, whole once it ends: its text, then each of its calls
        (``delta.tool_calls``, the arguments in one piece), then its finish reason with the
        answer's log-probabilities (when asked)."""
        content, calls = tools.tool_calls(text, self.tools)
        out = [self._chunk(index, {"content": content}, None, None)] if content else []
        for i, call in enumerate(calls):
            out.append(self._chunk(index, {"tool_calls": [{"index": i, **call}]}, None, None))
        finish = "tool_calls" if calls and last.finish_reason == "stop" else last.finish_reason
        end = Piece("", finish) if calls else last
        return [*out, self._chunk(index, {}, end, self._logprobs(tuple(logprobs)))]

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
