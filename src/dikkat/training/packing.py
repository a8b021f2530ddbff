"""Examples packed into rows of a fixed length that train exactly as each example alone: the
rows, their labels, document ids and positions, and the order training reads them in
(docs/finetune.md, "Data"). Packing several examples into a row, with a document mask so that
none attends to another and positions that restart at each, is how fine-tuning avoids padding
(Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination",
arXiv:2107.02027).

Shapes: ``R`` packed rows, ``L`` their length (``seq_len``).
"""

from __future__ import annotations

import bisect
import hashlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.validate import check_int

__all__ = ["IGNORE", "Example", "Packed", "batch_rows", "batches", "pack", "padded"]

IGNORE = -100  # the label of a position without loss: cross_entropy's default ignore_index


@dataclass(frozen=True)
class Example:
    """One training sequence: ``ids`` and, for each, whether it is a target of the loss;
    ``line``, the JSONL line it came from (None if made otherwise): the examples of one line
    stay on one side of :func:`split_examples`."""

    ids: tuple[int, ...]
    trained: tuple[bool, ...]
    line: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(self.ids))
        object.__setattr__(self, "trained", tuple(self.trained))
        if len(self.ids) != len(self.trained) or not self.ids:
            raise ValueError(
                "an example needs as many trained flags as ids, at least one: got "
                f"{len(self.ids)} ids and {len(self.trained)} flags"
            )


@dataclass(frozen=True)
class Packed:
    """Rows ready for the loss, (R, L) int64 tensors (``valid`` bool): a row's summed
    ``cross_entropy(model(ids, mask=masks.document(documents), positions=positions), labels)``
    is its examples' summed losses, each as if run alone."""

    ids: Tensor  # (R, L) the tokens, 0 at padding
    labels: Tensor  # (R, L) the token at t + 1 where it is trained and in t's document, else -100
    documents: Tensor  # (R, L) 0, 1, … along a row; the padding at its end one more document
    positions: Tensor  # (R, L) 0 at each document's first token
    valid: Tensor  # (R, L) False at padding
    truncated: int = 0  # examples longer than L, cut to their first L tokens

    @property
    def efficiency(self) -> float:
        """The fraction of the rows' positions that hold tokens, not padding."""
        return int(self.valid.sum()) / self.valid.numel()

    @property
    def targets(self) -> int:
        """The number of positions with a loss."""
        return int((self.labels != IGNORE).sum())

    def rows(self, index: Tensor | Sequence[int]) -> Packed:
        """The rows at ``index``, in its order."""
        index = torch.as_tensor(index, dtype=torch.long)
        cut = [t[index] for t in (self.ids, self.labels, self.documents, self.positions)]
        return Packed(*cut, self.valid[index], self.truncated)

    def to(self, device: str | torch.device) -> Packed:
        moved = [t.to(device) for t in (self.ids, self.labels, self.documents, self.positions)]
        return Packed(*moved, self.valid.to(device), self.truncated)


def pack(examples: Sequence[Example], seq_len: int) -> Packed:
    """``examples`` in rows of ``seq_len`` tokens, best fit decreasing: the longest first, each
    into the row it leaves least room in (the first such), a new row where none has room. Denser
    than in-order packing, which leaves a row's end empty wherever the next example does not fit,
    and the same for the same examples; the rows' order is no concern, :func:`batches` shuffles
    them. An example longer than ``seq_len`` is cut to its first ``seq_len`` tokens, counted in
    ``truncated`` and warned of: the length is the caller's choice, and an answer's start still
    teaches."""
    docs, truncated = _cut(examples, seq_len)
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    for k in sorted(range(len(docs)), key=lambda k: (-len(docs[k][0]), k)):
        n = len(docs[k][0])
        at = bisect.bisect_left(room, (n, -1))
        if at == len(room):
            rows.append([])
            left, row = seq_len, len(rows) - 1
        else:
            left, row = room.pop(at)
        rows[row].append(k)
        if left > n:
            bisect.insort(room, (left - n, row))
    return _tensors(docs, rows, seq_len, truncated)


def padded(examples: Sequence[Example], seq_len: int) -> Packed:
    """One example a row, in order, padded on the right to ``seq_len`` (cut as :func:`pack`
    cuts): what packing saves, for comparison (``efficiency``)."""
    docs, truncated = _cut(examples, seq_len)
    return _tensors(docs, [[k] for k in range(len(docs))], seq_len, truncated)


def batch_rows(rows: int, batch_size: int, step: int, *, seed: int = 0) -> Tensor:
    """The row indices of training step ``step`` (from 0). Epoch ``e`` reads the rows in an
    order drawn from (``seed``, ``e``), ``batch_size`` at a time, running on into the next
    epoch: every batch is full, each row read once an epoch. A function of the step alone, so
    that a run resumed at step s reads what it would have read."""
    rows, batch_size = check_int("rows", rows), check_int("batch_size", batch_size)
    step, seed = check_int("step", step, at_least=0), check_int("seed", seed, at_least=0)
    begin = step * batch_size  # type: ignore[operator]
    first, last = begin // rows, (begin + batch_size - 1) // rows  # type: ignore[operator]
    orders = [_order(rows, e, seed) for e in range(first, last + 1)]  # type: ignore[arg-type]
    return torch.cat(orders)[begin - first * rows :][:batch_size]


def batches(packed: Packed, batch_size: int, *, seed: int = 0, start: int = 0) -> Iterator[Packed]:
    """The batches of steps ``start``, ``start + 1``, … without end (:func:`batch_rows`)."""
    step = start
    while True:
        yield packed.rows(batch_rows(packed.ids.shape[0], batch_size, step, seed=seed))
        step += 1


def _order(rows: int, epoch: int, seed: int) -> Tensor:
    # the CPU generator (mt19937) keeps 32 bits of its seed: (seed, epoch) hashed down to them
    digest = hashlib.blake2b(f"{seed} {epoch}".encode(), digest_size=4).digest()
    return torch.randperm(
        rows, generator=torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    )


def _cut(examples: Sequence[Example], seq_len: int) -> tuple[list[tuple[tuple, tuple]], int]:
    """Each example's (ids, trained) cut to ``seq_len``, and how many were cut."""
    check_int("seq_len", seq_len, at_least=2)
    if not examples:
        raise ValueError("no examples to pack")
    for k, e in enumerate(examples):
        if not isinstance(e, Example):
            raise TypeError(f"examples[{k}] must be an Example, got {type(e).__name__}")
    long = [len(e.ids) for e in examples if len(e.ids) > seq_len]
    if long:
        warnings.warn(
            f"{len(long)} of {len(examples)} examples are longer than seq_len={seq_len} (up to "
            f"{max(long)} tokens) and were cut to their first {seq_len} tokens",
            stacklevel=3,
        )
    return [(e.ids[:seq_len], e.trained[:seq_len]) for e in examples], len(long)


def _tensors(docs: list[tuple[tuple, tuple]], rows: list[list[int]], L: int, cut: int) -> Packed:
    R = len(rows)
    ids = torch.zeros(R, L, dtype=torch.long)
    labels = torch.full((R, L), IGNORE, dtype=torch.long)
    documents, positions = torch.zeros_like(ids), torch.zeros_like(ids)
    valid = torch.zeros(R, L, dtype=torch.bool)
    count = torch.arange(L)
    for r, members in enumerate(rows):
        at = 0
        for d, k in enumerate(members):
            tokens, trained = torch.tensor(docs[k][0]), torch.tensor(docs[k][1])
            n = len(tokens)
            ids[r, at : at + n], documents[r, at : at + n] = tokens, d
            # position t predicts token t + 1 of its own document, where that one is trained
            labels[r, at : at + n - 1] = tokens[1:].masked_fill(~trained[1:], IGNORE)
            positions[r, at : at + n], valid[r, at : at + n] = count[:n], True
            at += n
        documents[r, at:], positions[r, at:] = len(members), count[: L - at]
    return Packed(ids, labels, documents, positions, valid, cut)
