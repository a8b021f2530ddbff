"""Tool calls in the chat endpoint (docs/server.md, "Tools"): the functions a request offers
(``tools``) told to the model, its answer held to a call where ``tool_choice`` asks for one,
and its calls read back into OpenAI's ``message.tool_calls``.

A chat template that knows tools (its text uses ``tools``: Qwen's, Llama 3's) renders them,
and the conversation's earlier calls and results, itself. For any other template dikkat
describes them in words of its own, in the system message or before the first user message's
text, writes earlier calls as the assistant's text and their results as a user's turn.

Whatever the template, a call is answered in one form, which the constraint enforces: a JSON
object ``{"name": …, "arguments": {…}}`` whose arguments follow the function's schema (or,
where ``parallel_tool_calls`` is on, a JSON array of them). ``required`` and a named function
hold the whole answer to that form (:func:`tool_constraint`; vLLM does the same); ``auto``
lets the model choose between a call and a text that does not begin as JSON does. A
template's own syntax, ``<tool_call>{…}</tool_call>`` (Hermes, as Qwen and SmolLM3 write it),
is read back too where an ``auto`` answer uses it; a call that names no offered function stays
text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from dikkat.generation.constraint import Constraint

Strict = ConfigDict(extra="forbid", strict=True)


class CalledFunction(BaseModel):
    model_config = Strict

    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    """A call an assistant's message made (OpenAI's ``tool_calls[i]``)."""

    model_config = Strict

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Function(BaseModel):
    model_config = Strict

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # the arguments always follow the schema here


class Tool(BaseModel):
    model_config = Strict

    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    model_config = Strict

    name: str


class NamedTool(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name"}}``."""

    model_config = Strict

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Protocol):
    """What this module reads of a chat request (:class:`dikkat.serving.protocol.ChatRequest`)."""

    tools: list[Tool] | None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None
    parallel_tool_calls: bool


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def active(body: ChatRequest) -> bool:
    """Whether the request offers tools the model may call."""
    return bool(body.tools) and body.tool_choice != "none"


def tool_constraint(body: ChatRequest) -> Constraint | None:
    """What holds the answer: a call's JSON (``required``, a named function), a call or a text
    (``auto``, the default with tools); None without tools or with ``tool_choice: "none"``."""
    if not active(body):
        return None
    tools = body.tools or []
    choice = body.tool_choice
    if isinstance(choice, NamedTool):
        tools = [t for t in tools if t.function.name == choice.function.name]
    calls = [_call_schema(t.function.name, t.function.parameters) for t in tools]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    several = {"type": "array", "items": one, "minItems": 1}
    answer = {"anyOf": [one, several]} if body.parallel_tool_calls else one  # one, or a list
    if choice in (None, "auto"):
        # a call, or a text that does not open as JSON (nor with the space before it)
        lark = f"start: call | text\ncall: %json {json.dumps(answer)}\ntext: /[^\\s{{\\[][\\s\\S]*/"
        return Constraint("grammar", lark)
    return Constraint("json_schema", json.dumps(answer, separators=(",", ":")))


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    arguments = parameters if parameters else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def instructions(body: ChatRequest) -> str:
    """The system text that tells a model whose template knows no tools what it may call."""
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    form = '{"name": <the function\'s name>, "arguments": {<its arguments>}}'
    several = " (or a JSON array of such objects, to call several)"
    text = (
        "You can call these functions:\n"
        + "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
        + f"\nTo call one, answer with only the JSON object {form}"
        + (several if body.parallel_tool_calls else "")
        + "."
    )
    if body.tool_choice in (None, "auto"):
        text += " Otherwise answer in plain text."
    return text


def conversation(messages: list[dict[str, Any]], body: ChatRequest, knows_tools: bool) -> list:
    """The messages (:func:`~dikkat.serving.params.chat_messages`' dicts, earlier calls under
    ``tool_calls``) as the template reads them: a template that knows tools gets the calls with
    their arguments as objects (transformers' convention) and the ``tool`` messages as they
    are. Another gets the calls as the assistant's text, the results as a user's turn (one for
    results in a row: such templates drop a ``tool`` role, or refuse turns that do not
    alternate), and the tools' description (:func:`instructions`) in the system message, or
    before the first user message's text where there is none, when tools are offered."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id → the function it called
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        names |= {c["id"]: c["name"] for c in calls or []}
        if m["role"] == "tool" and not knows_tools:  # a user's turn, of the results in a row
            called = names.get(m.get("tool_call_id", ""), "a function")
            said = f"The result of {called}: {m['content']}"
            if out and out[-1].get("results"):
                out[-1]["content"] += "\n" + said
            else:
                out.append({"role": "user", "content": said, "results": True})
            continue
        if calls and knows_tools:
            m["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"],
                 "arguments": _loads(c["arguments"])}}
                for c in calls
            ]  # fmt: skip
        elif calls:
            written = [{"name": c["name"], "arguments": _loads(c["arguments"])} for c in calls]
            text = json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)
            m["content"] = (m["content"] + "\n" if m["content"] else "") + text
        out.append(m)
    for m in out:
        m.pop("results", None)
    if active(body) and not knows_tools:
        # in the system message, or where there is none before the first user message's text
        # (some templates, Gemma's, take no system message)
        told = instructions(body)
        at = next((i for i, m in enumerate(out) if m["role"] in ("system", "user")), None)
        if at is None:
            out.insert(0, {"role": "system", "content": told})
        elif out[at]["role"] == "system":
            out[at] = {**out[at], "content": out[at]["content"] + "\n\n" + told}
        else:
            out[at] = {**out[at], "content": told + "\n\n" + out[at]["content"]}
    return out


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # as the client sent it


def tool_calls(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """An answer read back: (its text, or None where it is all calls; its calls in OpenAI's
    form). The answer's calls are the JSON form the constraint holds it to, or the
    ``<tool_call>`` blocks of a template's own syntax; a call that names no offered function,
    or whose arguments are not an object, leaves the answer as text."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        calls = _calls(_json(stripped), names)
        if calls:
            return None, calls
    blocks = _HERMES.findall(text)
    if blocks:
        calls = _calls([_json(b) for b in blocks], names)
        if len(calls) == len(blocks):
            rest = _HERMES.sub("", text).strip()
            return rest or None, calls
    return text, []


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _calls(found: Any, names: list[str]) -> list[dict[str, Any]]:
    items = found if isinstance(found, list) else [found]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        arguments = item.get("arguments", item.get("parameters"))
        if not isinstance(arguments, dict):
            return []
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": item["name"],
                    "arguments": json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    return calls
