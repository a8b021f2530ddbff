"""Supervised fine-tuning data: JSONL lines → token ids with the tokens to learn marked, packed
into rows of a fixed length that train exactly as each example alone (docs/finetune.md, "Data").

A line is ``{"messages": [...]}`` (OpenAI's chat form, optional ``"tools"``), ``{"text": ...}``
or ``{"prompt": ..., "completion": ...}`` (TRL's forms: https://huggingface.co/docs/trl/main/en/
dataset_formats). An assistant message's tokens are found for any chat template from what it
writes: the conversation rendered up to the message with the generation prompt (what the model
is given at inference) and through it without; the difference is what the model writes. Where
both are prefixes of the whole conversation's render (prefix-stable: Llama 3, Qwen 2.5, SmolLM2
and 3, Phi-3.5, Gemma 2), the conversation is one example with the ids of its whole text, the
messages' special-token strings encoded as text (:mod:`dikkat.pretrained.chat_tokens`). Where
a message renders differently once it is not the last (Qwen 3 drops an earlier answer's empty
``<think>`` block), each answer is an example of its own, its history rendered as the model sees
it then. A rendered answer that does not begin with its generation prompt (DeepSeek-R1's: the
prompt opens ``<think>``, answers lose their reasoning) is refused.

The examples are packed into rows by :mod:`dikkat.training.packing`; its names are
re-exported here, where the data is made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from dikkat.pretrained.chat_template import check_unicode, render_chat
from dikkat.pretrained.chat_tokens import ChatTokens
from dikkat.pretrained.tokenizer import Tokenizer
from dikkat.training.packing import (
    IGNORE,
    Example,
    Packed,
    batch_rows,
    batches,
    pack,
    padded,
)
from dikkat.validate import check_bool, check_int, check_probability

__all__ = [
    "IGNORE",
    "Example",
    "Packed",
    "Renderer",
    "batch_rows",
    "batches",
    "pack",
    "padded",
    "read_examples",
    "split_examples",
]


Pair = tuple[list[int], list[bool]]  # ids, and whether each is a target of the loss


class ChatModel(Protocol):
    """What reading data needs of a model: a :class:`~dikkat.pretrained.Pretrained` is one."""

    tokenizer: Tokenizer
    chat_template: str | None


class _UnstableError(ValueError):
    """A shorter conversation's render is not the start of a longer one's."""


class Renderer:
    """A JSONL line's object → its :class:`Example` s, in ``lm``'s tokenizer and chat template.

    ``special_in_content`` is :meth:`Pretrained.chat_ids`'s: False encodes a special token's
    string in the data (``<|im_end|>`` in a text) as text, so that no line forges a turn or an
    end; ``template``: further variables of the chat template (``enable_thinking=False``)."""

    def __init__(self, lm: ChatModel, *, special_in_content: bool = False, **template: Any):
        self.tokenizer, self.template, self.variables = lm.tokenizer, lm.chat_template, template
        self.special_in_content = check_bool("special_in_content", special_in_content)
        self._chat_tokens = ChatTokens(lm.tokenizer)

    def __call__(self, record: Any, line: int | None = None) -> list[Example]:
        """The examples of one line's object (``line``: its number, kept in them)."""
        if not isinstance(record, Mapping):
            raise ValueError(f"a line must hold a JSON object, got a {type(record).__name__}")
        keys = {"messages", "text", "prompt", "completion"} & record.keys()
        tools = record.get("tools")
        if keys == {"messages"}:
            pairs = self.chat(record["messages"], tools=tools)
        elif keys == {"text"}:
            if not _text("text", record["text"]):
                raise ValueError('"text" is empty: nothing to learn')
            pairs = [self.plain("", record["text"])]
        elif keys == {"prompt", "completion"}:
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, list) and isinstance(completion, list):  # TRL's conversational
                pairs = self.chat(prompt + completion, tools=tools, first=len(prompt))
            else:
                pairs = [self.plain(_text("prompt", prompt), _text("completion", completion))]
        else:
            raise ValueError(
                'a line holds "messages", "text", or "prompt" and "completion"; this one holds '
                f"{sorted(record)}" + (" (one form only)" if keys else "")
            )
        return [Example(ids, trained, line) for ids, trained in pairs]

    def plain(self, prompt: str, completion: str) -> Pair:
        """``prompt + completion`` encoded whole, BOS first where the tokenizer adds one, EOS
        appended so that the model learns to stop; the completion and the EOS are trained (a
        token the two share at their boundary with it)."""
        eos = self.tokenizer.eos_id
        if eos is None:
            raise ValueError("the tokenizer has no EOS token to end a text with")
        ids = self._ids([prompt, completion], lambda m: m[0] + m[1])
        start = _common(self._ids([prompt], lambda m: m[0]), ids) if prompt else 0
        bos = [self.tokenizer.bos_id] if self.tokenizer.add_bos else []
        trained = [False] * len(bos) + [k >= start for k in range(len(ids))] + [True]
        return [*bos, *ids, eos], trained  # type: ignore[list-item]

    def chat(self, messages: Any, *, tools: Any = None, first: int = 0) -> list[Pair]:
        """A conversation, its assistant messages from index ``first`` on trained: one pair, or
        one per answer where the template is not prefix-stable (the module docstring)."""
        if self.template is None:
            raise ValueError(
                'the model has no chat template (a base model) to render "messages" with: '
                'give "text" or "prompt" and "completion" lines'
            )
        _check_messages(messages)
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k >= first]
        if not turns:
            raise ValueError("the conversation has no assistant message to learn from")
        if turns[0] == 0:  # its prompt would be no conversation at all
            raise ValueError("messages[0] is the assistant's: a conversation opens with a prompt")
        variables = dict(self.variables)
        if tools is not None:
            if not isinstance(tools, list):
                raise ValueError(f'"tools" must be a list, got a {type(tools).__name__}')
            variables["tools"] = tools
        renders: dict[tuple[int, bool], tuple[str, list[int]]] = {}

        def render(n: int, prompt: bool) -> tuple[str, list[int]]:
            """The first ``n`` messages' text and ids, with the generation prompt if ``prompt``."""
            if (n, prompt) not in renders:
                text = self._render(messages[:n], prompt, variables)
                ids = self._ids(messages[:n], lambda m: self._render(m, prompt, variables))
                renders[n, prompt] = text, ids
            return renders[n, prompt]

        text, ids = render(len(messages), False)
        try:
            return [(ids, _flags(len(ids), [self._span(render, k, text, ids) for k in turns]))]
        except _UnstableError:  # a message renders otherwise once it is not the last
            pass
        pairs = []
        for k in turns:
            text, ids = render(k + 1, False)
            try:
                pairs.append((ids, _flags(len(ids), [self._span(render, k, text, ids)])))
            except _UnstableError as e:
                raise ValueError(f"messages[{k}]: {e}") from None
        return pairs

    def _span(
        self, render: Callable[[int, bool], tuple[str, list[int]]], k: int, text: str, ids: list
    ) -> tuple[int, int]:
        """Where assistant message ``k`` is in ``ids`` (of ``text``, a render that holds it):
        from the end of its generation prompt (a token the prompt shares with the answer at
        their boundary, ``\\n`` + ``\\n\\n`` → ``\\n\\n\\n``, is trained) through the first
        end-of-generation token after it, where generation stops: a newline the template writes
        after it is never generated, so it is not trained."""
        prompt_text, prompt_ids = render(k, True)
        through_text, through_ids = render(k + 1, False)
        if not (text.startswith(prompt_text) and through_text.startswith(prompt_text)):
            same = max(_common(prompt_text, through_text) - 20, 0)
            raise _UnstableError(
                f"the chat template's generation prompt ends {prompt_text[same:]!r} but it "
                f"writes the assistant's message as {through_text[same:][:60]!r}: it rewrites "
                "the answer (DeepSeek-R1's drops the reasoning), so what the model writes after "
                "the prompt cannot be told"
            )
        start, end = _common(prompt_ids, ids), _common(through_ids, ids)
        stop = next((t for t in range(start, end) if ids[t] in self.tokenizer.eos_ids), None)
        if stop is None:
            ends = [self.tokenizer.id_to_token(i) for i in sorted(self.tokenizer.eos_ids)]
            raise _UnstableError(
                f"the chat template writes none of the end-of-generation tokens {ends} after "
                "the assistant's message, so the model would not learn to stop"
            )
        return start, stop + 1

    def _render(self, messages: list, prompt: bool, variables: dict[str, Any]) -> str:
        bos, eos = self.tokenizer.bos_token or "", self.tokenizer.eos_token or ""
        return render_chat(
            self.template,  # type: ignore[arg-type]  # chat() checked it
            messages, add_generation_prompt=prompt, bos_token=bos, eos_token=eos, **variables,
        )  # fmt: skip

    def _ids(self, parts: list, render: Callable[[list], str]) -> list[int]:
        """The ids of ``render(parts)``, special tokens' strings in ``parts`` encoded as text
        unless ``special_in_content``; what ``render`` adds is matched as it is."""
        if self.special_in_content:
            return self.tokenizer.encode(render(parts), add_special=False)
        return self._chat_tokens.ids(parts, render)


def read_examples(
    path: str | os.PathLike, lm: ChatModel, *, special_in_content: bool = False, **template: Any
) -> list[Example]:
    """The examples of a JSONL file in its order, blank lines skipped, each with its line number
    (the keywords are :class:`Renderer`'s). A bad line is a ``ValueError`` naming the file, the
    line and what is wrong."""
    renderer = Renderer(lm, special_in_content=special_in_content, **template)
    out: list[Example] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                if line.strip():
                    out += renderer(json.loads(line), number)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}, line {number}: not UTF-8 text ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number}: not JSON: {e}") from None
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}, line {number}: {e}") from None
    return out


def split_examples(
    examples: Sequence[Example], eval_fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, eval): a random ``eval_fraction`` (in [0, 1)) of the lines held out, at least one
    where it is above 0 and there are two lines or more, the same for the same ``seed``; each
    side in the examples' order. One line's examples stay together, so that no held-out answer's
    history was trained on (an example with no line is a line of its own)."""
    fraction = check_probability("eval_fraction", eval_fraction)
    seed = check_int("seed", seed, at_least=0)  # type: ignore[assignment]
    groups: dict[tuple[bool, int], list[int]] = {}
    for k, example in enumerate(examples):
        key = (False, k) if example.line is None else (True, example.line)
        groups.setdefault(key, []).append(k)
    n = len(groups)
    if fraction == 0 or n < 2:
        if fraction > 0 and len(examples) > 1:
            raise ValueError(
                f"eval_fraction={eval_fraction} holds out whole lines, but the {len(examples)} "
                "examples all come from one line"
            )
        return list(examples), []
    count = min(n - 1, max(1, round(fraction * n)))
    drawn = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count].tolist()
    keys = list(groups)
    held = {k for j in drawn for k in groups[keys[j]]}
    train = [e for k, e in enumerate(examples) if k not in held]
    return train, [e for k, e in enumerate(examples) if k in held]


def _flags(n: int, spans: Sequence[tuple[int, int]]) -> list[bool]:
    flags = [False] * n
    for start, stop in spans:
        flags[start:stop] = [True] * (stop - start)
    return flags


def _common(a: Sequence, b: Sequence) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f'"{name}" must be a string, got {type(value).__name__} {value!r:.60}')
    check_unicode(f'"{name}"', value)
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'"messages" must be a non-empty list of messages, got {messages!r:.60}')
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{k}] must be an object, got {m!r:.60}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "none" if key not in m else f"{type(m[key]).__name__} {m[key]!r:.60}"
                raise ValueError(f"messages[{k}] needs a {key!r} string, got {got}")
