"""What the server needs of a tokenizer, from any of dikkat's: text ↔ ids, the ids that end an
answer, and each token's own text and bytes (for log-probabilities).

The server takes dikkat's byte tokenizer, a ``tokenizers`` tokenizer (:class:`dikkat.text.
HFTokenizer`, GPT-2's) or a pretrained model's (:class:`dikkat.pretrained.Tokenizer`, which
adds special tokens only when asked and leaves control tokens out of the text when asked).
:class:`Vocabulary` hides the difference: it reads which keywords ``encode`` and ``decode`` take.

A token's bytes: most tokens decode alone to whole characters; a byte-level token that holds
part of a multi-byte character decodes to U+FFFD, and its bytes are read from its spelling (the
GPT-2 byte-to-character table of byte-level BPE, or SentencePiece's ``<0xE2>`` byte tokens).
A token whose bytes are not UTF-8 on their own is written ``bytes:\\xe2\\x80`` where a string is
needed, as OpenAI writes it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from functools import cache, cached_property
from typing import Any

REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # SentencePiece's ▁, a space


@cache
def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character → byte: the printable bytes stand for
    themselves, and the other 68 bytes (controls, space, 0x7F-0xA0, 0xAD) are moved to U+0100
    and on, in byte order (Radford et al. 2019, GPT-2's ``encoder.py``)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in kept}
    moved = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


def _takes(fn: Callable[..., Any], keyword: str) -> bool:
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


class Vocabulary:
    """A tokenizer as the server uses it. ``vocab_size`` is the model's (an embedding may have
    more rows than the tokenizer has tokens: those ids have no text)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int] | None = None):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.known = min(int(getattr(tokenizer, "vocab_size", vocab_size)), self.vocab_size)
        self._add_special = _takes(tokenizer.encode, "add_special")
        self._skip_special = _takes(tokenizer.decode, "skip_special")
        spell = getattr(tokenizer, "id_to_token", None)
        if spell is None:  # a tokenizers.Tokenizer behind dikkat's HFTokenizer
            spell = getattr(getattr(tokenizer, "inner", None), "id_to_token", None)
        self._spell: Callable[[int], str | None] | None = spell
        self.eos_ids: tuple[int, ...] = tuple(
            sorted(int(i) for i in (end_ids(tokenizer) if eos_ids is None else eos_ids))
        )
        self._bytes: dict[int, bytes] = {}

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """The ids of ``text``; ``special=False`` adds no BOS / EOS (a chat template writes
        them itself), where the tokenizer would add them."""
        if self._add_special:
            return list(self.tokenizer.encode(text, add_special=special))
        return list(self.tokenizer.encode(text))

    @cached_property
    def longest_token(self) -> int:
        """At least the UTF-8 bytes of text any one token stands for: the longest spelling in the
        vocabulary (a spelling is never shorter than its text: GPT-2's byte characters, ``▁``
        and ``<0x0A>`` are each one byte of text and one or more of spelling), or, for a
        tokenizer that lists no spellings, the longest of :meth:`token_bytes`."""
        backend = getattr(self.tokenizer, "backend", None)  # a pretrained model's tokenizer
        if backend is None:
            backend = getattr(self.tokenizer, "inner", None)  # dikkat.text.HFTokenizer's
        spellings = getattr(backend, "get_vocab", None)
        if spellings is not None:
            return max(len(s.encode("utf-8")) for s in spellings(with_added_tokens=True))
        return max(len(self.token_bytes(t)) for t in range(self.known))

    def max_text(self, tokens: int) -> int:
        """The characters past which a text surely encodes to more than ``tokens`` tokens: each
        character is one byte or more, each token at most :attr:`longest_token` bytes (for a
        tokenizer that drops no text: byte-level BPE and SentencePiece with byte fallback)."""
        return tokens * self.longest_token

    @cached_property
    def specials(self) -> tuple[list[int], list[int]]:
        """The ids ``encode(text, special=True)`` puts before and after a text's own (BOS …)."""
        bare, full = self.encode("a", special=False), self.encode("a", special=True)
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return [], []

    def decode(self, ids: Sequence[int]) -> str:
        """The text shown to a client: control tokens left out (where the tokenizer knows them),
        and ids past the tokenizer's vocabulary too (they have no text)."""
        known = [i for i in ids if i < self.known]
        if self._skip_special:
            return self.tokenizer.decode(known, skip_special=True)
        return self.tokenizer.decode(known)

    def decode_all(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` with the control tokens written out (``/detokenize``)."""
        return self.tokenizer.decode([i for i in ids if i < self.known])

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes one token stands for (a control token: its spelling)."""
        found = self._bytes.get(token)
        if found is None:
            found = self._bytes[token] = self._read_bytes(token)
        return found

    def token_text(self, token: int) -> str:
        """The token's text, or ``bytes:\\xe2\\x80`` when its bytes are not whole characters."""
        raw = self.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _read_bytes(self, token: int) -> bytes:
        if not 0 <= token < self.known:
            return b""
        text = self.tokenizer.decode([token])
        spelling = self._spell(token) if self._spell is not None else None
        if REPLACEMENT not in text:
            if spelling and spelling.startswith(_SPACE) and not text.startswith(" "):
                text = " " + text  # SentencePiece drops the space of a text's first word
            return text.encode("utf-8")
        if spelling is not None:
            if m := _BYTE_TOKEN.fullmatch(spelling):
                return bytes([int(m.group(1), 16)])
            table = byte_level_table()
            if spelling and all(ch in table for ch in spelling):
                return bytes(table[ch] for ch in spelling)
        elif self.known == 256:  # dikkat's byte tokenizer: the id is the byte
            return bytes([token])
        return text.encode("utf-8")


def end_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end an answer: a pretrained tokenizer's ``eos_ids`` (EOS and the chat
    formats' end-of-turn tokens), else the end-of-text token of a ``tokenizers`` tokenizer
    (GPT-2's ``<|endoftext|>``); dikkat's byte tokenizer has none."""
    eos = getattr(tokenizer, "eos_ids", None)
    if eos is not None:
        return tuple(sorted(int(i) for i in eos))
    token_to_id = getattr(getattr(tokenizer, "inner", None), "token_to_id", None)
    end = token_to_id("<|endoftext|>") if token_to_id is not None else None
    return () if end is None else (int(end),)


class Offsets:
    """Where each token's text begins in the text of the tokens so far, one token at a time.

    A token's text is not the decoded sequence's slice by itself alone: a byte-level token can
    end inside a character, and SentencePiece drops the space of a text's first word. So the
    text is grown as an incremental detokenizer grows it: the ids since the last complete
    character are decoded after a short run of earlier ids, and the new characters are those
    past the run's own text (the method of vLLM's ``detokenize_incrementally``). A token that
    ends inside a character begins where the text stood before it; so does the next one.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], start: int = 0) -> None:
        self.decode, self.ids = decode, []  # type: ignore[var-annotated]
        self.length = start  # characters settled so far
        self._prefix = self._read = 0  # the run before the unsettled ids; the unsettled ids

    def push(self, token: int) -> int:
        """Add ``token``; returns the offset of its text (the characters settled before it)."""
        offset = self.length
        self.ids.append(token)
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.length += len(after) - len(before)
            self._prefix, self._read = self._read, len(self.ids)
        return offset


def offsets(
    decode: Callable[[Sequence[int]], str], ids: Sequence[int], start: int = 0
) -> list[int]:
    """Each token's :class:`Offsets` offset, counted from ``start``."""
    tracker = Offsets(decode, start)
    return [tracker.push(t) for t in ids]
