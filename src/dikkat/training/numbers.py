"""The built-in translation task: numbers in digits → numbers in English words, no download.

``"4721"`` → ``"four thousand seven hundred twenty-one"``, for 0 ≤ n ≤ 999,999 (American English,
no "and"). A fixed held-out set and a validation set are drawn once from a seed; the training
sampler never draws them, so exact match on the held-out numbers measures generalisation.

Token layout: source = one token per digit; target = ``<bos>`` words ``<eos>``; both right-padded
with ``<pad>`` = 0. Shapes: ``B`` batch, ``S`` source length, ``T`` target length.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

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
_DIGIT0_ID = len(SPECIALS)


def _check_number(n: object, name: str = "n") -> int:
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


_GROUPS = [_group_words(k) for k in range(1000)]  # a number is read as two such groups


def number_to_words(n: int) -> str:
    """``n`` (0..999,999) in American English words without "and".

    >>> number_to_words(4721)
    'four thousand seven hundred twenty-one'
    """
    thousands, rest = divmod(_check_number(n), 1000)
    if not thousands:
        return _GROUPS[rest]
    head = f"{_GROUPS[thousands]} thousand"
    return f"{head} {_GROUPS[rest]}" if rest else head


# ------------------------------------------------------------------------------------ tokenizer

_PIECE = re.compile(r"\d|-|[^\s\d-]+")  # one digit, one hyphen, or a word


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
        return [self._ids.get(p, UNK_ID) for p in _PIECE.findall(text)]

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
        from dikkat.files import atomic_write

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


_WORD_IDS = [[TOKENS.index(w) for w in _PIECE.findall(g)] for g in _GROUPS]  # per 0..999
_THOUSAND_ID = TOKENS.index("thousand")
MAX_SRC_LEN = len(str(MAX_NUMBER))  # 6 digits
MAX_WORD_TOKENS = 2 * max(map(len, _WORD_IDS)) + 1  # 11: "seven hundred seventy-seven thousand …"
MAX_TGT_LEN = MAX_WORD_TOKENS + 2  # with <bos> and <eos>


def _digit_ids(n: int) -> list[int]:
    return [_DIGIT0_ID + int(c) for c in str(n)]


def _word_ids(n: int) -> list[int]:
    """Same as ``NumberTokenizer().encode(number_to_words(n))``, from the 0..999 table."""
    thousands, rest = divmod(n, 1000)
    if not thousands:
        return _WORD_IDS[rest]
    return _WORD_IDS[thousands] + [_THOUSAND_ID] + (_WORD_IDS[rest] if rest else [])


def _right_pad(rows: list[list[int]]) -> Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long)


def _as_numbers(numbers: Iterable[int], name: str = "numbers") -> list[int]:
    values = numbers.tolist() if isinstance(numbers, Tensor) else list(numbers)
    if not values:
        raise ValueError(f"{name} is empty")
    return [_check_number(n, f"{name}[{i}]") for i, n in enumerate(values)]


def encode_numbers(numbers: Iterable[int]) -> Tensor:
    """Source ids (B, S): one token per digit, right-padded with ``<pad>``."""
    return _right_pad([_digit_ids(n) for n in _as_numbers(numbers)])


def encode_pairs(numbers: Iterable[int]) -> tuple[Tensor, Tensor]:
    """Source ids (B, S) and target ids (B, T) = ``<bos>`` words ``<eos>``, right-padded."""
    ns = _as_numbers(numbers)
    src = _right_pad([_digit_ids(n) for n in ns])
    return src, _right_pad([[BOS_ID, *_word_ids(n), EOS_ID] for n in ns])


# ---------------------------------------------------------------------------------- data splits


@dataclass(frozen=True)
class NumberSplit:
    """The numbers kept out of training: a held-out test set and a validation set (disjoint)."""

    heldout: tuple[int, ...]  # the exact-match test numbers, sorted
    val: tuple[int, ...]  # for validation loss / early exact match, sorted

    @cached_property
    def exclude(self) -> Tensor:
        """Bool mask (MAX_NUMBER + 1,): True at every held-out or validation number."""
        return exclude_mask([*self.heldout, *self.val])

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        """Unpacks as ``heldout, val = make_splits()``."""
        return iter((self.heldout, self.val))


def make_splits(seed: int = 0, n_heldout: int = 1000, n_val: int = 1000) -> NumberSplit:
    """Draw ``n_heldout`` + ``n_val`` distinct numbers uniformly from 0..999,999 (seeded)."""
    for name, v in (("n_heldout", n_heldout), ("n_val", n_val)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name} must be ≥ 0, got {v}")
    if n_heldout + n_val > MAX_NUMBER:  # leave at least one number to train on
        raise ValueError(
            f"n_heldout + n_val = {n_heldout + n_val:,} leaves nothing of 0..{MAX_NUMBER:,} to "
            "train on"
        )
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(MAX_NUMBER + 1, generator=g)[: n_heldout + n_val].tolist()
    return NumberSplit(tuple(sorted(perm[:n_heldout])), tuple(sorted(perm[n_heldout:])))


def exclude_mask(numbers: Iterable[int]) -> Tensor:
    """Bool mask (MAX_NUMBER + 1,) that is True at ``numbers`` (for ``sample_batch``)."""
    values = numbers.tolist() if isinstance(numbers, Tensor) else list(numbers)
    mask = torch.zeros(MAX_NUMBER + 1, dtype=torch.bool)
    if not values:
        return mask
    ids = torch.as_tensor(values)  # vectorised checks: this may run every training step
    if ids.dtype in (torch.bool, torch.uint8) or ids.dtype.is_floating_point or ids.dim() != 1:
        raise TypeError(f"exclude must hold ints, got {ids.dtype} of shape {tuple(ids.shape)}")
    bad = ids[(ids < 0) | (ids > MAX_NUMBER)]
    if len(bad):
        raise ValueError(f"exclude must hold numbers in 0..{MAX_NUMBER:,}, got {bad[0].item():,}")
    mask[ids] = True
    return mask


# smallest and one past the largest number with 1, 2, …, 6 digits
_LOW = torch.tensor([0, 10, 100, 1_000, 10_000, 100_000])
_HIGH = torch.tensor([10, 100, 1_000, 10_000, 100_000, 1_000_000])


def _draw(n: int, generator: torch.Generator) -> Tensor:
    """``n`` numbers (n,): each, by a coin flip, uniform over 0..999,999 or log-uniform.

    Uniform draws alone are 90% six-digit numbers and give a number below 1,000 once in a
    thousand draws, so "zero", the teens or "one hundred" alone would barely be seen. The
    log-uniform half picks a digit count 1–6 uniformly, then a number with that many digits,
    so each magnitude gets 1/12 of the batch; the uniform half keeps the held-out distribution
    (uniform, mostly six digits) the main training distribution.
    """
    uniform = torch.randint(0, MAX_NUMBER + 1, (n,), generator=generator)
    digits = torch.randint(0, 6, (n,), generator=generator)  # digit count - 1
    lo, hi = _LOW[digits], _HIGH[digits]
    frac = torch.rand(n, generator=generator, dtype=torch.float64)
    log_uniform = lo + (frac * (hi - lo)).long()  # frac < 1, so < hi
    use_log = torch.rand(n, generator=generator) < 0.5
    return torch.where(use_log, log_uniform, uniform)


def _check_positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def sample_numbers(n: int, generator: torch.Generator, exclude: Tensor | Iterable[int]) -> Tensor:
    """``n`` training numbers (n,) never in ``exclude`` (a mask from ``exclude_mask`` or numbers).

    Excluded draws are rejected and redrawn, so the result is deterministic given the generator.
    """
    _check_positive(n, "n")
    mask = exclude if isinstance(exclude, Tensor) and exclude.dtype == torch.bool else None
    if mask is None:
        mask = exclude_mask(exclude)
    if mask.shape != (MAX_NUMBER + 1,):
        raise ValueError(
            f"exclude mask must have shape ({MAX_NUMBER + 1},), got {tuple(mask.shape)}"
        )
    kept: list[Tensor] = []
    have = 0
    while have < n:
        cand = _draw(n - have, generator)
        cand = cand[~mask[cand]]
        # checked only when a whole draw was rejected: mask.all() costs more than the batch
        if not len(cand) and bool(mask.all()):
            raise ValueError("exclude covers every number in 0..999,999: nothing left to train on")
        kept.append(cand)
        have += len(cand)
    return torch.cat(kept)[:n]


def sample_batch(
    batch_size: int, generator: torch.Generator, exclude: Tensor | Iterable[int]
) -> tuple[Tensor, Tensor]:
    """A training batch: source ids (B, S) and target ids (B, T), as in ``encode_pairs``.

    Pass ``NumberSplit.exclude`` (a precomputed mask) to keep the held-out and validation
    numbers out; a plain collection of numbers works too, but is turned into a mask every call.
    """
    _check_positive(batch_size, "batch_size")
    return encode_pairs(sample_numbers(batch_size, generator, exclude).tolist())


# ----------------------------------------------------------------------------------- evaluation


class Translator(Protocol):
    """What ``exact_match`` needs of a model (``dikkat.models.Seq2Seq`` is one)."""

    def generate(
        self,
        src: list[list[int]],
        max_new_tokens: int,
        *,
        bos_id: int,
        eos_id: int | None = None,
        pad_id: int = 0,
    ) -> list[list[int]]: ...


def exact_match(
    model: Translator,
    numbers: Sequence[int],
    tokenizer: NumberTokenizer,
    batch_size: int = 250,
) -> float:
    """Fraction of ``numbers`` whose greedy translation equals ``number_to_words`` exactly.

    A row counts as right when its tokens up to ``<eos>`` decode to exactly the words and hold
    no special token (``decode`` drops those silently, which would hide a stray ``<unk>``).
    """
    ns = _as_numbers(numbers)
    _check_positive(batch_size, "batch_size")
    right = 0
    for start in range(0, len(ns), batch_size):
        chunk = ns[start : start + batch_size]
        src = [tokenizer.encode(str(n)) for n in chunk]
        out = model.generate(
            src, max_new_tokens=MAX_WORD_TOKENS + 1, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID
        )
        for n, ids in zip(chunk, out, strict=True):
            body = ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
            clean = all(i >= len(SPECIALS) for i in body)
            right += int(clean and tokenizer.decode(body) == number_to_words(n))
    return right / len(ns)
