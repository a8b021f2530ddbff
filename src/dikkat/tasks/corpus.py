"""Text corpora that need no download, random training windows over them, and the base of the
text tasks (``lm``, ``mlm``) that train on them.

The default corpus is the Python standard library's own ``.py`` sources of the running
interpreter: real, varied, plentiful text that every machine with Python has. Files are split
into train and validation by a seeded shuffle, so no file contributes to both.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import ByteLevelBPETokenizer
from torch import Tensor

from dikkat.tasks.base import Task, TaskSpec
from dikkat.text import ByteTokenizer, HFTokenizer

TEXT_SUFFIXES = {
    ".py",
    ".txt",
    ".md",
    ".rst",
    ".json",
    ".toml",
    ".cfg",
    ".ini",
    ".html",
    ".c",
    ".h",
}


def stdlib_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library (no site-packages, no tests)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no standard-library sources found under {root}")
    return sorted(files)


def text_files(path: str | Path) -> list[Path]:
    """One text file, or the text files below a folder (by suffix), sorted."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if files:
            return files
        raise ValueError(f"--data {p} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    raise FileNotFoundError(f"--data {p} does not exist")


@dataclass(frozen=True)
class Corpus:
    """Train and validation text, split by file."""

    train: str
    val: str
    n_train_files: int
    n_val_files: int
    source: str


def load_corpus(
    data: str | Path | None = None,
    *,
    val_fraction: float = 0.05,
    seed: int = 0,
    max_bytes: int | None = None,
) -> Corpus:
    """Read ``data`` (a file or folder; default: the standard library) and split it by file.

    A single file is split by position instead (its last ``val_fraction`` is validation).
    ``max_bytes`` caps the training text (files are taken in shuffled order).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    files = stdlib_files() if data is None else text_files(data)
    source = "python-stdlib" if data is None else str(data)
    if len(files) == 1:
        text = files[0].read_text(encoding="utf-8", errors="replace")
        cut = int(len(text) * (1 - val_fraction))
        if cut <= 0 or cut >= len(text):
            raise ValueError(f"{files[0]} is too short to split into train and validation")
        return Corpus(text[:cut], text[cut:], 1, 1, source)
    order = list(files)
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(order) * val_fraction))
    val_files, train_files = order[:n_val], order[n_val:]

    def read(paths: Sequence[Path], cap: int | None) -> str:
        parts, total = [], 0
        for f in paths:
            t = f.read_text(encoding="utf-8", errors="replace")
            parts.append(t)
            total += len(t)
            if cap is not None and total >= cap:
                break
        return "\n\n".join(parts)

    val_cap = None if max_bytes is None else max(max_bytes // 10, 1)
    return Corpus(
        read(train_files, max_bytes), read(val_files, val_cap), len(train_files), n_val, source
    )


def encode_corpus(text: str, tokenizer: object) -> Tensor:
    """Token ids of ``text`` as one 1-D tensor (uint8 for bytes, else int32)."""

    if isinstance(tokenizer, ByteTokenizer):
        return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy())
    return torch.tensor(tokenizer.encode(text), dtype=torch.int32)  # type: ignore[attr-defined]


def random_windows(
    ids: Tensor, batch_size: int, length: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``batch_size`` random windows: inputs (B, length) and next-token targets (B, length)."""
    if ids.numel() < length + 2:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than a window of {length + 1}")
    starts = torch.randint(0, ids.numel() - length - 1, (batch_size,), generator=generator)
    idx = starts.unsqueeze(1) + torch.arange(length + 1)  # (B, length + 1)
    window = ids[idx].long()
    return window[:, :-1], window[:, 1:]


def _train_bpe(text: str, vocab_size: int) -> HFTokenizer:
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    return HFTokenizer(tok)


class CorpusTask(Task):
    """Shared by ``lm`` and ``mlm``: a tokenized corpus split into train and validation ids."""

    def __init__(self, spec: TaskSpec, tokenizer: Any | None = None) -> None:
        self.spec = spec
        corpus = load_corpus(spec.data, seed=spec.seed, max_bytes=spec.max_bytes)
        if tokenizer is not None:  # a saved run's: it must be the kind the run was trained with
            expected = ByteTokenizer if spec.tokenizer == "bytes" else HFTokenizer
            if not isinstance(tokenizer, expected):
                raise ValueError(
                    f"this {spec.task} run was trained with the {spec.tokenizer!r} tokenizer, "
                    f"but its checkpoint holds a {type(tokenizer).__name__}"
                )
        else:
            tokenizer = (
                ByteTokenizer()
                if spec.tokenizer == "bytes"
                else _train_bpe(corpus.train, spec.vocab_size)
            )
        self.tokenizer = tokenizer
        self.corpus_source = corpus.source
        self.ids = {
            "train": encode_corpus(corpus.train, tokenizer),
            "val": encode_corpus(corpus.val, tokenizer),
        }
        # nats/token → nats/byte: the loss per byte of text is comparable across tokenizers
        bytes_per_token = len(corpus.val.encode("utf-8")) / max(1, self.ids["val"].numel())
        self.report_scale = 1.0 / bytes_per_token
