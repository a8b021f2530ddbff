"""The OpenAI wire format the server speaks: request models and error objects.

The request fields are those of OpenAI's legacy completions endpoint
(https://platform.openai.com/docs/api-reference/completions/create) that dikkat can honour; any
other field is refused (``extra="forbid"``) rather than silently ignored, and types are strict
(``"5"`` is not a number, ``true`` is not an integer).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOPS = 4  # OpenAI's limit on stop sequences


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # one last chunk with the request's token counts


class CompletionRequest(BaseModel):
    """``POST /v1/completions``: continue one prompt (text, or a list of token ids)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[int]
    max_tokens: int = Field(default=16, ge=1)  # OpenAI's default
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end user's id for the caller's own logs; unused here


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, dict[str, Any]]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def stop_list(stop: str | list[str] | None) -> list[str]:
    """The ``stop`` field as a list of non-empty strings; ``ValueError`` naming it otherwise."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise ValueError(f"stop holds {len(stops)} strings; at most {MAX_STOPS} are allowed")
    if any(s == "" for s in stops):
        raise ValueError("stop holds an empty string, which would stop before the first token")
    return stops


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's validation errors → (one readable message, the first field named)."""
    parts: dict[str, str] = {}  # one message per top-level field (a union gives one per member)
    for e in errors:
        where = [str(x) for x in e.get("loc", ())]
        field = where[0] if where else ""
        if e.get("type") == "json_invalid":
            parts[field] = f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}"
        elif e.get("type") == "extra_forbidden":
            parts[field] = f"unknown field {field!r}"
        elif not where:
            parts[field] = "the body must be a JSON object"
        elif field in parts:
            parts[field] = f"{field} has the wrong type (got {e.get('input')!r})"
        else:
            parts[field] = f"{'.'.join(where)}: {e['msg']} (got {e.get('input')!r})"
    return "; ".join(parts.values()), next((f for f in parts if f), None)


Usage = dict[str, int]


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: Literal["stop", "length"] | None,
    usage_counts: Usage | None,
) -> dict[str, Any]:
    """A ``text_completion`` object: the whole answer, or one streamed chunk of it."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage_counts is not None:
        body["usage"] = usage_counts
    return body
