"""Chat messages → the prompt text a model was trained on, written by the model's own template.

A chat model ships its prompt format as a Jinja template (a GGUF header's
``tokenizer.chat_template``, an HF folder's ``chat_template.jinja`` or ``tokenizer_config.json``).
:func:`render_chat` renders one as transformers' ``apply_chat_template(..., tokenize=False)``
does (https://huggingface.co/docs/transformers/main/en/chat_templating_writing): in a sandbox
(the template is code from a model's files), with ``trim_blocks`` and ``lstrip_blocks``, the
``break``/``continue`` loop controls, a ``tojson`` filter that keeps non-ASCII text as it is, and
the globals ``raise_exception`` (a template's way to refuse a conversation) and
``strftime_now``. A base model without a template has none: its callers refuse chat.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["hf_chat_template", "render_chat"]


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """``messages`` (``[{"role": "user", "content": "Hi"}, …]``) written out by ``template``,
    ending with the assistant's header when ``add_generation_prompt``. ``extra`` reaches the
    template as further variables (``tools``, ``documents``, ``unk_token``, …; ``tools`` and
    ``documents`` are None unless given, as in transformers).

    The text holds the template's special tokens as text (``<|im_start|>``): encode it without
    adding BOS, ``tokenizer.encode(text, add_special=False)``.
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a str, got {type(template).__name__}")
    _check_messages(messages)
    variables = {"tools": None, "documents": None, **extra}
    try:
        return _compiled(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except jinja2.TemplateError as e:  # raise_exception, or a template error found at run time
        raise ValueError(f"the chat template refused the conversation: {e.message}") from None


def hf_chat_template(folder: str | Path, config: Mapping[str, Any] | None = None) -> str | None:
    """The default chat template of a Hugging Face folder (None when it has none), found where
    transformers looks: ``chat_template.jinja``, else ``chat_template`` in its
    ``tokenizer_config.json`` (``config``) — a string, or a list of named templates of which the
    one named ``default`` is taken."""
    path = Path(folder) / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = (config or {}).get("chat_template")
    if isinstance(
        template, list
    ):  # [{"name": "default", "template": ...}, {"name": "tool_use", …}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"the chat template in {folder} is a {type(template).__name__}, not a str")
    return template


def _check_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            value = message.get(key)
            if not isinstance(value, str):
                got = "nothing" if key not in message else f"{type(value).__name__} {value!r}"
                raise ValueError(f"messages[{i}][{key!r}] must be a str, got {got}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change a prompt's text
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    """The template compiled once (a model's template is rendered at every chat turn)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}): {e}") from None
