"""A reasoning model's thinking, split from its answer (docs/server.md, "Reasoning"): a model
whose chat template writes ``<think>`` (Qwen 3, SmolLM3, the DeepSeek-R1 distills) thinks
between ``<think>`` and ``</think>`` before it answers. The server returns the thinking as
``message.reasoning_content`` (streamed as ``delta.reasoning_content``) and the rest as
``content``, as vLLM's reasoning parsers do. A template may open the tag in the prompt itself
(DeepSeek-R1's, Qwen 3's with thinking off writes both): the prompt's end says whether the
answer begins inside the tag. One that never closes it (cut by ``max_tokens``) is all
thinking.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(the thinking, or None where there is none; the answer) of a whole text; ``opened``: the
    prompt ends with ``<think>`` (the text begins inside it)."""
    splitter = Splitter(opened)
    parts = [*splitter.push(text), *splitter.finish()]
    thinking = [t for kind, t in parts if kind == "reasoning"]
    answer = "".join(t for kind, t in parts if kind == "content")
    return ("".join(thinking) if splitter.thought else None), answer


class Splitter:
    """A streamed text cut into ``("reasoning", text)`` and ``("content", text)`` pieces as it
    comes; text that may be the start of a tag is held until the next piece says."""

    def __init__(self, opened: bool = False) -> None:
        self._held = ""
        self._state = "reasoning" if opened else "start"  # → reasoning → closed → content
        self.thought = opened  # whether the text thinks at all

    def push(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        out: list[tuple[str, str]] = []
        while self._held:
            if self._state == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self._state, self._held, self.thought = "reasoning", stripped[len(OPEN) :], True
                elif OPEN.startswith(stripped):
                    break  # "<thi…": the tag may be coming
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                at = self._held.find(CLOSE)
                if at >= 0:
                    out.append(("reasoning", self._held[:at]))
                    self._state, self._held = "closed", self._held[at + len(CLOSE) :]
                    continue
                keep = _partial_tail(self._held, CLOSE)
                out.append(("reasoning", self._held[: len(self._held) - keep]))
                self._held = self._held[len(self._held) - keep :]
                break
            elif self._state == "closed":  # the newlines after the tag belong to neither
                self._held = self._held.lstrip("\n")
                self._state = "content" if self._held else "closed"
            else:
                out.append(("content", self._held))
                self._held = ""
        return [(kind, t) for kind, t in out if t]

    def finish(self) -> list[tuple[str, str]]:
        """What is held when the text ends: thinking if it was thinking, else answer."""
        kind = "reasoning" if self._state == "reasoning" else "content"
        held, self._held = self._held, ""
        return [(kind, held)] if held else []


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
