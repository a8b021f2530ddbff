"""The language of the numbers task: 0 … 999,999 in American English words, and its tokenizer.

``"4721"`` ↔ ``"four thousand seven hundred twenty-one"`` (no "and"). The vocabulary is fixed:
four specials, the ten digits, the number words and "-" (45 tokens); a saved tokenizer records
it, so a checkpoint of another vocabulary is refused rather than read with the wrong ids. The
task that trains on it is :mod:`dikkat.tasks.translate`.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from dikkat.files import atomic_write

MAX_NUMBER = 999_999

# fmt: off
_UNITS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen",
)
_TENS = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
# fmt: on

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
DIGITS = tuple("0123456789")
WORDS = (*_UNITS, *_TENS, "hundred", "thousand", "-")
TOKENS = (*SPECIALS, *DIGITS, *WORDS)  # id = position
DIGIT0_ID = len(SPECIALS)


def check_number(n: object, name: str = "n") -> int:
    """``n`` as an ``int`` in 0..MAX_NUMBER; ``bool`` and ``float`` are refused, not coerced."""
    if isinstance(n, bool):
        raise TypeError(f"{name} must be an int, got bool {n}")
    try:
        i = operator.index(n)  # int, numpy and 0-d torch integers; not float or str
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}") from None
    if not 0 <= i <= MAX_NUMBER:
        raise ValueError(f"{name} must be in 0..{MAX_NUMBER:,}, got {i:,}")
    return i


def _group_words(k: int) -> str:
    """0 ≤ k ≤ 999 in words; "zero" for 0 (callers drop it inside larger numbers)."""
    hundreds, rest = divmod(k, 100)
    parts = [f"{_UNITS[hundreds]} hundred"] if hundreds else []
    if rest >= 20:
        tens, units = divmod(rest, 10)
        parts.append(_TENS[tens - 2] + (f"-{_UNITS[units]}" if units else ""))
    elif rest or not hundreds:
        parts.append(_UNITS[rest])
    return " ".join(parts)


GROUPS = [_group_words(k) for k in range(1000)]  # a number is read as two such groups


def number_to_words(n: int) -> str:
    """``n`` (0..999,999) in American English words without "and".

    >>> number_to_words(4721)
    'four thousand seven hundred twenty-one'
    """
    thousands, rest = divmod(check_number(n), 1000)
    if not thousands:
        return GROUPS[rest]
    head = f"{GROUPS[thousands]} thousand"
    return f"{head} {GROUPS[rest]}" if rest else head


PIECE = re.compile(r"\d|-|[^\s\d-]+")  # one digit, one hyphen, or a word


class NumberTokenizer:
    """Word-level tokenizer of this task: digits, number words and "-" (45 tokens, fixed).

    Same protocol as ``dikkat.text.ByteTokenizer``. ``encode`` adds no ``<bos>``/``<eos>`` (the
    batch code does); unknown pieces become ``<unk>``.

    >>> tok = NumberTokenizer()
    >>> tok.decode(tok.encode("twenty-one")), tok.decode(tok.encode("4721"))
    ('twenty-one', '4721')
    """

    type_name = "number-words"  # the "type" in tokenizer_config.json
    tokens = TOKENS
    vocab_size = len(TOKENS)
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID
    _ids: ClassVar[dict[str, int]] = {t: i for i, t in enumerate(TOKENS) if i >= len(SPECIALS)}

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(p, UNK_ID) for p in PIECE.findall(text)]

    def decode(self, ids: Iterable[int]) -> str:
        # Glue digits to digits and "-" to both neighbours, so "4721" and "twenty-one" survive
        # a round trip; drop specials and out-of-range ids (a generated row may hold them).
        out: list[str] = []
        prev = ""
        for i in ids:
            if not len(SPECIALS) <= i < len(TOKENS):
                continue
            t = TOKENS[i]
            glue = not out or t == "-" or prev == "-" or (t.isdigit() and prev.isdigit())
            out.append(t if glue else " " + t)
            prev = t
        return "".join(out)

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer_config.json`` (type and token list) atomically into ``directory``."""
        config = {"type": self.type_name, "tokens": list(TOKENS)}
        path = Path(directory) / "tokenizer_config.json"
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(config)))

    @classmethod
    def from_config(
        cls, config: dict[str, Any], source: str = "tokenizer config"
    ) -> NumberTokenizer:
        """The tokenizer a saved config describes; ``ValueError`` if its vocabulary differs."""
        if config.get("type") != cls.type_name:
            raise ValueError(f"{source} has type {config.get('type')!r}, not {cls.type_name!r}")
        if tuple(config.get("tokens", ())) != TOKENS:
            raise ValueError(
                f"{source} holds a number-words vocabulary of {len(config.get('tokens', ()))} "
                f"tokens that differs from this version's {len(TOKENS)}; it was saved by an "
                "incompatible dikkat"
            )
        return cls()
