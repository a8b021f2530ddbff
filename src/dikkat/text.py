"""Tokenizers: text ↔ ids. Byte-level by default; BPE files through the ``tokenizers`` library.

A checkpoint directory holds either ``tokenizer.json`` (any ``tokenizers`` tokenizer, e.g. a BPE
trained on the data, or GPT-2's) or nothing, meaning raw UTF-8 bytes (vocabulary 256).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: str | Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no unknown tokens, vocabulary 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # a generated sequence may stop inside a multi-byte character
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        from dikkat.models.io import atomic_write

        path = Path(directory) / "tokenizer_config.json"
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps({"type": "bytes"})))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (BPE, WordPiece, …) behind the same three methods."""

    def __init__(self, tokenizer: object) -> None:
        self.inner = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size()  # type: ignore[attr-defined]

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text).ids  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)  # type: ignore[attr-defined]

    def save(self, directory: str | Path) -> None:
        from dikkat.models.io import atomic_write

        atomic_write(Path(directory) / "tokenizer.json", lambda tmp: self.inner.save(tmp))  # type: ignore[attr-defined]

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer as _Tokenizer

        return cls(_Tokenizer.from_file(str(path)))


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer saved in a checkpoint or HF model directory; bytes if there is none.

    Reads ``tokenizer.json``, or GPT-2's ``vocab.json`` + ``merges.txt`` (byte-level BPE), or a
    ``tokenizer_config.json`` of type ``"number-words"`` (the built-in translation task).
    """
    d = Path(directory)
    if (d / "tokenizer.json").is_file():
        return HFTokenizer.from_file(d / "tokenizer.json")
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        from tokenizers import ByteLevelBPETokenizer

        return HFTokenizer(ByteLevelBPETokenizer(str(d / "vocab.json"), str(d / "merges.txt")))
    config_path = d / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from None
        if isinstance(config, dict) and config.get("type") == "number-words":
            from dikkat.training.numbers import NumberTokenizer  # lazily: training imports us

            return NumberTokenizer.from_config(config, str(config_path))
    return ByteTokenizer()
