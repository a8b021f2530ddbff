"""From a checked request to what the engine takes: prompts as token ids that fit the model's
context, and the new tokens each gets (the request's own ``to_sampling_params`` makes its
:class:`~dikkat.generation.SamplingParams`, :mod:`dikkat.serving.protocol`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from dikkat.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    Message,
    RequestError,
    Sampling,
    stop_list,
)
from dikkat.serving.tokens import Vocabulary

# messages → the prompt's token ids in the model's chat template, ready for the assistant's turn
# (``Pretrained.chat_ids``: the contents tokenised as text, the template's markup as special ids)
ChatIds = Callable[..., list[int]]  # (messages, **template variables) → prompt ids


def completion_prompts(body: CompletionRequest, vocab: Vocabulary, max_len: int) -> list[list[int]]:
    """The prompts of a completions request as token ids: a string, a list of strings, a list
    of ids, or a list of lists of ids. Each must have at least one token, every id in the
    vocabulary; a text too long to fit ``max_len`` tokens is refused before it is encoded."""
    prompt = body.prompt
    if isinstance(prompt, str):
        check_text(len(prompt), vocab, max_len, "the prompt", "prompt")
        prompts = [vocab.encode(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts: list[str] = list(prompt)  # type: ignore[arg-type]
        for i, text in enumerate(texts):
            check_text(len(text), vocab, max_len, f"prompt[{i}]", "prompt")
        prompts = [vocab.encode(t) for t in texts]
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
    else:
        prompts = [list(prompt)]  # type: ignore[arg-type]
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        check_ids(ids, vocab.vocab_size, where, "prompt")
    return prompts


def check_ids(ids: Sequence[int], vocab_size: int, where: str, param: str) -> None:
    if not ids:
        raise RequestError(f"{where} encodes to no tokens; give at least one", param=param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"{where} holds token ids outside the vocabulary of {vocab_size}: {bad[:5]}",
            param=param,
        )


def chat_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as a chat template reads them: ``{"role", "content"}`` with the content as one
    string (text parts joined); OpenAI's ``developer`` role is the templates' ``system``."""
    out = []
    for m in messages:
        if isinstance(m.content, list):
            content = "".join(p.text or p.refusal or "" for p in m.content)
        else:
            content = m.content or ""
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content,
        }
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:  # (written for the template by dikkat.serving.tools.conversation)
            message["tool_calls"] = [
                {
                    "id": c.id or f"call_{i}",
                    "name": c.function.name,
                    "arguments": c.function.arguments,
                }
                for i, c in enumerate(m.tool_calls)
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def check_text(length: int, vocab: Vocabulary, max_len: int, where: str, param: str) -> None:
    """Refuse, before encoding it, a text of ``length`` characters that cannot fit ``max_len``
    tokens (:meth:`Vocabulary.max_text`): encoding a text takes time in its length, and the
    answer would be a refusal anyway."""
    bound = vocab.max_text(max_len)
    if length > bound:
        raise RequestError(
            f"{where} has {length:,} characters; the model's context is {max_len} tokens, which "
            f"hold at most {bound:,} characters (no token of this vocabulary is longer than "
            f"{vocab.longest_token} bytes)",
            param=param,
            code="context_length_exceeded",
        )


def conversation_ids(
    messages: Sequence[Message],
    chat_ids: ChatIds | None,
    vocab: Vocabulary,
    max_len: int,
    model: str,
    prepare: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
    **template: Any,
) -> list[int]:
    """The conversation in the model's chat template as token ids, ready for the assistant's
    turn (the template writes its special tokens, BOS included, itself). Contents too long to
    fit ``max_len`` tokens are refused before the template runs. ``prepare`` rewrites the
    messages first (tool calls: :func:`dikkat.serving.tools.conversation`); ``template`` are
    further variables of the template (``tools``)."""
    if chat_ids is None:
        raise RequestError(
            f"{model} has no chat template (a base model): use /v1/completions with a text prompt",
            param="messages",
            code="chat_template_missing",
        )
    conversation = chat_messages(messages)
    if prepare is not None:
        conversation = prepare(conversation)
    length = sum(len(m["content"]) for m in conversation)
    check_text(length, vocab, max_len, "the conversation's contents", "messages")
    try:
        return list(chat_ids(conversation, **template))
    except Exception as e:  # a template's own raise_exception, one too long, or a jinja error
        why = (
            str(e) if "chat template" in str(e) else f"the chat template refused the messages: {e}"
        )
        raise RequestError(why, param="messages") from None


def room(prompt_len: int, max_tokens: int | None, max_len: int, param: str, where: str) -> int:
    """The new tokens a prompt gets: ``max_tokens``, refused when it does not fit the context;
    None: all the context left. A prompt that fills the context is refused unless no token is
    asked for (``max_tokens: 0`` scores a prompt)."""
    if prompt_len > max_len or (prompt_len == max_len and max_tokens != 0):
        raise RequestError(
            f"{where} has {prompt_len} tokens; the model's context is {max_len} tokens, so at "
            f"most {max_len - 1} leave room for a new token",
            param="messages" if where == "the conversation" else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_len - prompt_len
    if prompt_len + max_tokens > max_len:
        raise RequestError(
            f"{param}={max_tokens} with {where} of {prompt_len} tokens needs "
            f"{prompt_len + max_tokens} positions, past the model's context of {max_len}; at "
            f"most {max_len - prompt_len} new tokens fit",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def stops_of(body: Sampling) -> list[str]:
    try:
        return stop_list(body.stop)
    except ValueError as e:
        raise RequestError(str(e), param="stop") from None


def chat_max_tokens(body: ChatRequest) -> tuple[int | None, str]:
    """The chat request's limit on new tokens, and the field that set it."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def finite(value: float) -> float:
    """A log-probability JSON can carry: -inf (a token the model rules out) as -9999.0, the
    number OpenAI and vLLM send."""
    return value if math.isfinite(value) else -9999.0
