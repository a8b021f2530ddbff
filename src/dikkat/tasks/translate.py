"""The ``translate`` task: a Seq2Seq learns numbers in digits → the same numbers in English words.

No download: the pairs are generated (:mod:`dikkat.text.number_words`). A fixed held-out set and
a validation set are drawn once from a seed; the training sampler never draws them, so exact
match on the held-out numbers measures generalisation.

Token layout: source = one token per digit; target = ``<bos>`` words ``<eos>``; both right-padded
with ``<pad>`` = 0. Shapes: ``B`` batch, ``S`` source length, ``T`` target length.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.models.seq2seq import Seq2Seq, Seq2SeqConfig
from dikkat.tasks.base import Task, TaskInfo, TaskSpec, new_model, register_task
from dikkat.text.number_words import (
    BOS_ID,
    DIGIT0_ID,
    EOS_ID,
    GROUPS,
    MAX_NUMBER,
    PAD_ID,
    PIECE,
    SPECIALS,
    TOKENS,
    NumberTokenizer,
    check_number,
    number_to_words,
)

_WORD_IDS = [[TOKENS.index(w) for w in PIECE.findall(g)] for g in GROUPS]  # per 0..999
_THOUSAND_ID = TOKENS.index("thousand")
MAX_SRC_LEN = len(str(MAX_NUMBER))  # 6 digits
MAX_WORD_TOKENS = 2 * max(map(len, _WORD_IDS)) + 1  # 11: "seven hundred seventy-seven thousand …"
MAX_TGT_LEN = MAX_WORD_TOKENS + 2  # with <bos> and <eos>


def _digit_ids(n: int) -> list[int]:
    return [DIGIT0_ID + int(c) for c in str(n)]


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
    return [check_number(n, f"{name}[{i}]") for i, n in enumerate(values)]


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


# ---------------------------------------------------------------------------------------- task


class TranslateTask(Task):
    """Seq2Seq: numbers in digits → English words, exact match on held-out numbers."""

    def __init__(self, spec: TaskSpec, tokenizer: Any | None = None) -> None:
        self.spec = spec
        if tokenizer is not None and not isinstance(tokenizer, NumberTokenizer):
            raise ValueError(
                f"a translate run uses the number-words tokenizer, but its checkpoint holds a "
                f"{type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer or NumberTokenizer()
        split = make_splits(seed=spec.seed)
        self.heldout, self.val_numbers = split.heldout, split.val
        self.exclude = split.exclude  # a precomputed mask: never train on these numbers
        V = self.tokenizer.vocab_size
        overrides = {
            "src_vocab_size": V,
            "tgt_vocab_size": V,
            "max_len": 64,
            **spec.model_overrides,
        }
        torch.manual_seed(spec.seed)
        self.model = new_model(Seq2Seq, Seq2SeqConfig.preset(spec.preset, **overrides))

    def batch(self, split: str, generator: torch.Generator, batch_size: int) -> dict[str, Tensor]:
        if split == "train":
            src, tgt = sample_batch(batch_size, generator, self.exclude)
        else:
            pick = torch.randint(0, len(self.val_numbers), (batch_size,), generator=generator)
            src, tgt = encode_pairs([self.val_numbers[i] for i in pick.tolist()])
        return {"src": src, "tgt": tgt}

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        src, tgt = batch["src"], batch["tgt"]
        # targets are right-padded: the causal mask alone keeps real tokens off the padding
        logits = model(src, tgt[:, :-1], src_valid=src != 0)
        targets = tgt[:, 1:].masked_fill(tgt[:, 1:] == 0, -100)  # no loss on padding
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return loss, int((targets != -100).sum())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"heldout_exact_match": exact_match(model, self.heldout, self.tokenizer)}


register_task(
    TaskInfo(
        name="translate",
        build=lambda spec, tokenizer: TranslateTask(spec, tokenizer),
        help="the 2017 encoder-decoder, numbers in digits → English words (exact match)",
        recipe={"steps": 1200, "batch_size": 64, "lr": 2e-3},
        size_flags={
            "d_model": "d_model",
            "heads": "n_heads",
            "dropout": "dropout",
            "layers": ("n_encoder_layers", "n_decoder_layers"),
        },
    )
)
