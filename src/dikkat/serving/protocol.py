"""The OpenAI wire format the server reads: request models, refusals and error objects.

Every request field of OpenAI's completions and chat completions endpoints
(https://platform.openai.com/docs/api-reference/completions/create,
https://platform.openai.com/docs/api-reference/chat/create) is accepted: honoured, or taken and
ignored where it cannot change the answer (``user``, ``store``, ``metadata``, ``service_tier``
…), or refused by name where honouring it is impossible (``suffix``, the deprecated
``functions``: :func:`refusal`). A field OpenAI does not have is refused as unknown, and
types are strict (``"5"`` is not a number, ``true`` is not an integer). docs/server.md has the
table. ``top_k`` is accepted too, as vLLM accepts it, and the fields that hold the text to a
constraint (:meth:`Sampling.constraint`: OpenAI's ``response_format``, vLLM's and
llama-server's own).

A request converts itself into the engine's :class:`~dikkat.generation.SamplingParams`
(``to_sampling_params``, after vLLM's ``vllm/entrypoints/openai/protocol.py``): each field is the
client's value, else the server's default (the tokenizer's end-of-generation ids, the context
left), else OpenAI's (the field's default here). The values are checked once, by
``SamplingParams`` itself, whose refusal becomes a :class:`RequestError` naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dikkat.generation import SamplingParams
from dikkat.serving.refused import RequestError
from dikkat.serving.structured import request_constraint
from dikkat.serving.tools import NamedTool, Tool, ToolCall

MAX_STOPS = 16  # OpenAI allows 4; lm-evaluation-harness sends its task's stops and the EOS
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (5 for completions; vLLM allows 20 for both)
MAX_CHOICES = 128  # OpenAI's limit on n

Strict = ConfigDict(extra="forbid", strict=True)
Ignored = Any  # a field taken and ignored: any JSON value
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # a negative seed is taken mod 2**64


class Request(BaseModel):
    """A request object: strict types, no unknown field, and a field sent as ``null`` is a field
    not sent (OpenAI's fields are nullable; many clients send every one)."""

    model_config = Strict

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(Request):
    include_usage: bool = False  # one last chunk with the request's token counts
    include_obfuscation: Ignored = None  # padding against side channels: nothing to hide here
    continuous_usage_stats: Ignored = None  # vLLM's: not given


class Sampling(Request):
    """The fields both endpoints share."""

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's; -1, 0 or None: all tokens
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) → bias in [-100, 100]
    ignore_eos: bool = False  # vLLM's and llama-server's: the stop tokens end nothing
    min_tokens: int = Field(default=0, ge=0)  # vLLM's: no stop token before this many tokens
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # vLLM's: seen tokens' logits scaled
    repeat_penalty: float | None = Field(default=None, gt=0.0)  # llama-server's name for it
    user: Ignored = None  # an end user's id for the caller's own logs
    # what the text must match (docs/server.md, "Structured outputs"): OpenAI's field (vLLM
    # takes it on completions too), vLLM's object and its older guided_* fields, llama-server's
    response_format: dict[str, Ignored] | None = None  # text, json_object or json_schema
    structured_outputs: dict[str, Ignored] | None = None
    guided_json: str | dict[str, Ignored] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Ignored = None  # one engine here: llguidance
    json_schema: dict[str, Ignored] | None = None
    grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        vocab_size: int,
        *,
        n: int,
        logprobs: bool,
        top_logprobs: int,
        prompt_logprobs: bool = False,
    ) -> SamplingParams:
        """The fields both endpoints share, in the engine's terms (OpenAI's ``top_p = 1`` and
        vLLM's ``top_k`` of -1 or 0 mean no cut; a negative seed is taken mod 2**64;
        ``ignore_eos`` drops the stop tokens); stop strings are matched by the server, not the
        engine."""
        bias = token_biases(self.logit_bias, vocab_size)
        repetition_penalty = self._repetition_penalty()
        constraint = self.constraint()[0]
        if self.min_tokens > max_new_tokens:
            raise RequestError(
                f"min_tokens={self.min_tokens} exceeds the {max_new_tokens} new tokens this "
                "request may make (max_tokens, or the context left)",
                param="min_tokens",
            )
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=float(self.temperature),
                top_p=None if self.top_p == 1.0 else float(self.top_p),
                top_k=self.top_k if self.top_k not in (None, -1, 0) else None,
                seed=None if self.seed is None else self.seed % 2**64,
                stop_ids=() if self.ignore_eos else tuple(stop_ids),
                n=n,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                prompt_logprobs=prompt_logprobs,
                frequency_penalty=float(self.frequency_penalty),
                presence_penalty=float(self.presence_penalty),
                logit_bias=bias,
                min_new_tokens=self.min_tokens,
                repetition_penalty=repetition_penalty,
                **constraint,
            )
        except (TypeError, ValueError) as e:
            raise RequestError(str(e), param=self._field_named(str(e))) from None

    def constraint(self) -> tuple[dict[str, Any], str | None]:
        """The constraint the request sets, as ``SamplingParams``' fields, and the request's
        field that set it (:func:`~dikkat.serving.structured.request_constraint`)."""
        return request_constraint(self)

    def _repetition_penalty(self) -> float:
        """``repetition_penalty`` (vLLM's name) or ``repeat_penalty`` (llama-server's): one, or
        both alike."""
        vllm, llama = float(self.repetition_penalty), self.repeat_penalty
        if llama is not None and "repetition_penalty" in self.model_fields_set and llama != vllm:
            raise RequestError(
                f"repetition_penalty={vllm} and repeat_penalty={llama} are one setting: give one",
                param="repeat_penalty",
            )
        return vllm if llama is None else float(llama)

    def _field_named(self, message: str) -> str | None:
        """The request's field a refusal of ``SamplingParams`` is about: its messages begin
        with the field's name (:mod:`dikkat.validate`), which most fields share with OpenAI's."""
        first = re.match(r"\w+", message)
        name = first.group() if first else None
        return name if name in type(self).model_fields else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(Sampling):
    """``POST /v1/completions``: continue one prompt or several (text, or token ids)."""

    prompt: Prompt
    max_tokens: int = Field(default=16, ge=0)  # OpenAI's default; 0 with echo scores a prompt
    echo: bool = False  # the prompt before its completion (with logprobs: its log-probabilities)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None  # refused unless empty: no dikkat model fills in a middle

    def to_sampling_params(self, stop_ids: Sequence[int], vocab_size: int) -> SamplingParams:
        """The parameters of every prompt of the request: ``best_of`` choices each (the server
        keeps the ``n`` best), every token's log-probability when the best are to be chosen,
        the prompt's with ``echo``."""
        best_of = self.best_of or self.n
        return self._sampling_params(
            self.max_tokens,
            stop_ids,
            vocab_size,
            n=best_of,
            logprobs=self.logprobs is not None or best_of > self.n,
            top_logprobs=self.logprobs or 0,
            prompt_logprobs=self.echo and self.logprobs is not None,
        )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: str
    text: str | None = None  # the other part types (image_url, input_audio, file) are refused
    refusal: str | None = None
    image_url: Ignored = None
    input_audio: Ignored = None
    file: Ignored = None


class Message(BaseModel):
    """One message of a conversation: an assistant's may carry its tool calls, a ``tool``
    message the result of one (``tool_call_id``)."""

    model_config = Strict

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Ignored = None
    audio: Ignored = None


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``: the assistant's next message."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # None: the rest of the context
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None  # functions the model may call (docs/server.md, "Tools")
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True  # OpenAI's default: several calls in one answer
    chat_template_kwargs: dict[str, Ignored] | None = None  # vLLM's: the template's variables
    functions: list[Ignored] | None = None  # the deprecated form of tools: refused
    function_call: Ignored = None  # the deprecated form of tool_choice: refused
    audio: Ignored = None  # refused unless null: no audio out
    modalities: list[str] | None = None  # ["text"] only
    web_search_options: Ignored = None  # refused unless null
    prediction: Ignored = None  # predicted output only speeds a model up: the answer is the same
    reasoning_effort: Ignored = None  # dikkat's models do not reason before they answer
    verbosity: Ignored = None
    store: Ignored = None
    metadata: Ignored = None
    service_tier: Ignored = None
    safety_identifier: Ignored = None
    prompt_cache_key: Ignored = None  # prefix reuse is automatic (docs/engine.md)
    prompt_cache_options: Ignored = None
    prompt_cache_retention: Ignored = None
    moderation: Ignored = None

    def to_sampling_params(
        self, max_new_tokens: int, stop_ids: Sequence[int], vocab_size: int
    ) -> SamplingParams:
        """The parameters of the answer: ``max_new_tokens`` is the client's ``max_tokens`` (or
        ``max_completion_tokens``), else the context the conversation leaves."""
        return self._sampling_params(
            max_new_tokens,
            stop_ids,
            vocab_size,
            n=self.n,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
        )


class TokenizeRequest(Request):
    """``POST /tokenize`` (vLLM's): a prompt, or messages in the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    return_token_strs: bool = False


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[int]


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, dict[str, Any]]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def token_biases(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) as ``{id: bias}``: a key must be
    the decimal id of a token of the vocabulary (the bias's range is ``SamplingParams``')."""
    out = {}
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdecimal() else None
        if token is None or token >= vocab_size:
            raise RequestError(
                f"logit_bias names {key!r}, not a token id of the vocabulary of {vocab_size}",
                param="logit_bias",
            )
        out[token] = value
    return out


def stop_list(stop: str | list[str] | None) -> list[str]:
    """The ``stop`` field as a list of non-empty strings; ``ValueError`` naming it otherwise."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise ValueError(f"stop holds {len(stops)} strings; at most {MAX_STOPS} are allowed")
    if any(s == "" for s in stops):
        raise ValueError("stop holds an empty string, which would stop before the first token")
    return stops


def refusal(body: CompletionRequest | ChatRequest) -> tuple[str, str] | None:
    """(the field, why) for the first field of ``body`` this server cannot honour, else None."""
    if isinstance(body, CompletionRequest):
        if body.suffix:
            return "suffix", "suffix is not supported: no dikkat model fills in a middle"
        if body.best_of is not None and body.best_of < body.n:
            return "best_of", f"best_of={body.best_of} must be at least n={body.n}"
        if body.best_of is not None and body.best_of > body.n and body.stream:
            return "best_of", "best_of > n cannot be streamed: the best are known at the end"
        return None
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
    if taken := sorted(reserved & set(body.chat_template_kwargs or {})):
        return "chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(taken)}"
    if body.functions or body.function_call is not None:
        name = "functions" if body.functions else "function_call"
        return name, f"{name} is the deprecated form of tools: send tools and tool_choice"
    names = [t.function.name for t in body.tools or []]
    if len(set(names)) < len(names):
        return "tools", f"tools name a function twice: {names}"
    choice = body.tool_choice
    if choice not in (None, "none", "auto") and not names:
        return "tool_choice", "tool_choice asks for a call, and no tools are given"
    if isinstance(choice, NamedTool) and choice.function.name not in names:
        why = f"tool_choice names {choice.function.name!r}, which is not among the tools {names}"
        return "tool_choice", why
    held_by = body.constraint()[1]  # the field of a constraint on the text, if any
    if names and choice != "none" and held_by is not None:
        return held_by, "tools and a constraint on the text cannot both hold the answer: give one"
    if body.audio is not None:
        return "audio", "audio output is not supported: only text comes out"
    if any(m != "text" for m in body.modalities or []):
        return "modalities", f"modalities={body.modalities}: only text comes out"
    if body.web_search_options is not None:
        return "web_search_options", "web_search_options is not supported: no web search"
    if body.top_logprobs and not body.logprobs:
        return "top_logprobs", "top_logprobs needs logprobs: true"
    both = (body.max_tokens, body.max_completion_tokens)
    if None not in both and both[0] != both[1]:
        why = f"max_tokens={both[0]} and max_completion_tokens={both[1]} disagree; give one"
        return "max_completion_tokens", why
    for i, m in enumerate(body.messages):
        if m.function_call is not None:
            where = f"messages[{i}].function_call"
            return where, f"{where} is the deprecated form of tool_calls: send tool_calls"
        if m.audio is not None:
            return f"messages[{i}].audio", f"messages[{i}].audio: only text goes in"
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type not in ("text", "refusal"):
                where = f"messages[{i}].content[{j}].type"
                return where, f"{where} is {part.type!r}: only text goes in"
    return None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's validation errors → (one readable message, the first field named)."""
    parts: dict[str, str] = {}  # one message per top-level field (a union gives one per member)
    for e in errors:
        where = [str(x) for x in e.get("loc", ())]
        field = where[0] if where else ""
        if e.get("type") == "json_invalid":
            parts[field] = f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}"
        elif e.get("type") == "extra_forbidden":
            parts[field] = f"unknown field {'.'.join(where)!r}"
        elif not where:
            parts[field] = "the body must be a JSON object"
        elif field in parts:
            parts[field] = f"{field} has the wrong type (got {_short(e.get('input'))})"
        else:
            parts[field] = f"{'.'.join(where)}: {e['msg']} (got {_short(e.get('input'))})"
    return "; ".join(parts.values()), next((f for f in parts if f), None)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
