"""Chat messages → the prompt text a model was trained on, written by the model's own template.

A chat model ships its prompt format as a Jinja template (a GGUF header's
``tokenizer.chat_template``, an HF folder's ``chat_template.jinja`` or ``tokenizer_config.json``).
:func:`render_chat` renders one as transformers' ``apply_chat_template(..., tokenize=False)``
does (https://huggingface.co/docs/transformers/main/en/chat_templating_writing): in a sandbox
(the template is code from a model's files), with ``trim_blocks`` and ``lstrip_blocks``, the
``break``/``continue`` loop controls, a ``tojson`` filter that keeps non-ASCII text as it is, and
the globals ``raise_exception`` (a template's way to refuse a conversation) and
``strftime_now``. A base model without a template has none: its callers refuse chat.

A render is bounded in steps, seconds and characters (:mod:`dikkat.pretrained.template_sandbox`
says what counts): a template that loops without end or builds a huge text is refused in one
line instead of hanging. The defaults are :data:`MAX_RENDER_STEPS`, :data:`MAX_RENDER_SECONDS`
and :data:`MAX_RENDER_CHARS` (read at each call: set them to change every render), or
``render_chat``'s keywords for one render.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

from dikkat.pretrained.template_sandbox import (
    BoundedSandbox,
    Budget,
    TemplateLimitError,
    active_budget,
)
from dikkat.validate import check_float, check_int

__all__ = [
    "MAX_RENDER_CHARS",
    "MAX_RENDER_SECONDS",
    "MAX_RENDER_STEPS",
    "check_unicode",
    "hf_chat_template",
    "render_chat",
]

# The bounds of a render. A real template takes a few steps per message (SmolLM2's, about ten),
# so five million steps is a conversation of hundreds of thousands of messages; a second of
# rendering is already far more than any real template needs.
MAX_RENDER_STEPS = 5_000_000
MAX_RENDER_SECONDS = 5.0
MAX_RENDER_CHARS = 100_000_000  # in the rendered text, and in any one value a template makes


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    max_steps: int | None = None,
    max_seconds: float | None = None,
    max_chars: int | None = None,
    **extra: Any,
) -> str:
    """``messages`` (``[{"role": "user", "content": "Hi"}, …]``) written out by ``template``,
    ending with the assistant's header when ``add_generation_prompt``. ``extra`` reaches the
    template as further variables (``tools``, ``documents``, ``unk_token``, …; ``tools`` and
    ``documents`` are None unless given, as in transformers).

    The text holds the template's special tokens as text (``<|im_start|>``): encode it without
    adding BOS, ``tokenizer.encode(text, add_special=False)``.

    The render stops with a ``ValueError`` past ``max_steps`` steps, ``max_seconds`` seconds or
    ``max_chars`` characters (None: :data:`MAX_RENDER_STEPS`, :data:`MAX_RENDER_SECONDS`,
    :data:`MAX_RENDER_CHARS`), as it does when the template fails or refuses the conversation.
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a str, got {type(template).__name__}")
    _check_messages(messages)
    budget = Budget(
        max_steps=check_int("max_steps", MAX_RENDER_STEPS if max_steps is None else max_steps),
        max_seconds=check_float(
            "max_seconds", MAX_RENDER_SECONDS if max_seconds is None else max_seconds,
            low=0, low_open=True,
        ),
        max_chars=check_int("max_chars", MAX_RENDER_CHARS if max_chars is None else max_chars),
    )  # fmt: skip
    variables = {"tools": None, "documents": None, **extra}
    compiled = _compiled(template)
    slot = active_budget()
    token = slot.set(budget)
    try:
        chunks = []
        for chunk in compiled.generate(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        ):
            budget.output(chunk)
            chunks.append(chunk)
        return "".join(chunks)
    except TemplateLimitError as e:
        raise ValueError(
            f"the chat template ran past its limit of {e}: it loops or grows without end, or "
            "the conversation is too long for the limit (docs/models.md, 'Chat templates')"
        ) from None
    except jinja2.TemplateError as e:  # raise_exception, or a template error found at run time
        raise ValueError(f"the chat template refused the conversation: {e.message}") from None
    except RecursionError:
        raise ValueError(
            "the chat template recursed deeper than Python allows (a macro or a recursive loop "
            "that calls itself without end)"
        ) from None
    except Exception as e:  # the template's own code failed: 'a' + 1, a missing key, …
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        slot.reset(token)


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
        for key, value in message.items():
            if isinstance(value, str):
                check_unicode(f"messages[{i}][{key!r}]", value)


def check_unicode(name: str, text: str) -> None:
    """Refuse ``text`` (called ``name`` in the error) when it holds a lone surrogate: what bytes
    that are not UTF-8 become when Python decodes them with ``surrogateescape`` (``argv``,
    a file read so). No tokenizer takes one (``tokenizers`` raises a ``TypeError``)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode text: character {e.start} is a lone surrogate "
            f"(U+{ord(text[e.start]):04X}), as bytes that are not UTF-8 become"
        ) from None


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
    """The template compiled once (a model's template is rendered at every chat turn). Jinja
    folds constant expressions while it compiles (filters included), so the compile runs
    under the default bounds too."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.add_filters({"tojson": _tojson})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    slot = active_budget()
    token = slot.set(
        Budget(
            max_steps=MAX_RENDER_STEPS, max_seconds=MAX_RENDER_SECONDS, max_chars=MAX_RENDER_CHARS
        )
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}): {e}") from None
    except TemplateLimitError as e:
        raise ValueError(f"the chat template ran past its limit of {e} as it compiled") from None
    finally:
        slot.reset(token)
