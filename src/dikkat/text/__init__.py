"""Tokenizers: text ↔ ids. Byte-level by default; BPE files through the ``tokenizers`` library.

A checkpoint folder records its tokenizer: ``tokenizer.json`` (any ``tokenizers`` tokenizer, e.g.
a BPE trained on the data, or GPT-2's), GPT-2's ``vocab.json`` + ``merges.txt``, or a
``tokenizer_config.json`` naming a built-in one (``bytes``: raw UTF-8, vocabulary 256;
``number-words``: the translation task's, :mod:`dikkat.text.number_words`; ``none``: images).
A folder with none of them has no tokenizer — :func:`load_tokenizer` says so instead of
guessing one, since ids read with another tokenizer than the model's are wrong without any error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from tokenizers import ByteLevelBPETokenizer
from tokenizers import Tokenizer as _Tokenizer

from dikkat import runs
from dikkat.files import atomic_write
from dikkat.text.number_words import NumberTokenizer

TOKENIZER_FILES = ("tokenizer.json", "vocab.json + merges.txt", "tokenizer_config.json")


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
        # the batch call releases the GIL while it works (a server tokenises in a thread)
        return self.inner.encode_batch([text])[0].ids  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)  # type: ignore[attr-defined]

    def save(self, directory: str | Path) -> None:
        atomic_write(Path(directory) / "tokenizer.json", lambda tmp: self.inner.save(tmp))  # type: ignore[attr-defined]

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        try:
            return cls(_Tokenizer.from_file(str(path)))
        except Exception as e:  # the library raises its own Exception subclass for bad files
            raise ValueError(f"{path} is not a readable tokenizer file: {e}") from None


class NoTokenizer:
    """Images need no tokenizer; a run still records one, so this one records that."""

    vocab_size = 0
    type_name = "none"

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / "tokenizer_config.json"
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps({"type": self.type_name})))


def load_tokenizer(directory: str | Path, *, verify: bool = True) -> Tokenizer:
    """The tokenizer saved in a model folder, a run's current checkpoint or an HF model folder.

    Reads ``tokenizer.json``, or GPT-2's ``vocab.json`` + ``merges.txt`` (byte-level BPE), or a
    ``tokenizer_config.json`` of type ``"bytes"``, ``"number-words"`` or ``"none"``.
    ``FileNotFoundError`` if the folder has none of them, ``ValueError`` if one is damaged (in a
    run's checkpoint, checked against its manifest unless ``verify=False``).
    """
    d = runs.checkpoint_dir(directory)
    if verify:
        runs.verify_checkpoint(d, ("tokenizer.json", "tokenizer_config.json"))
    if (d / "tokenizer.json").is_file():
        return HFTokenizer.from_file(d / "tokenizer.json")
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        try:
            return HFTokenizer(ByteLevelBPETokenizer(str(d / "vocab.json"), str(d / "merges.txt")))
        except Exception as e:  # the tokenizers library's own error type
            raise ValueError(f"{d}'s vocab.json / merges.txt are not readable: {e}") from None
    config_path = d / "tokenizer_config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{d} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    kind = config.get("type") if isinstance(config, dict) else None
    if kind not in _SAVED_TYPES:
        raise ValueError(
            f"{config_path} names no tokenizer dikkat knows (type {kind!r}; expected one of "
            f"{sorted(_SAVED_TYPES)})"
        )
    return _SAVED_TYPES[kind](config, str(config_path))


# the built-in tokenizers a tokenizer_config.json can name, by its "type"
_SAVED_TYPES: dict[str, Callable[[dict, str], Tokenizer]] = {
    "bytes": lambda config, source: ByteTokenizer(),
    NoTokenizer.type_name: lambda config, source: NoTokenizer(),  # type: ignore[dict-item]
    NumberTokenizer.type_name: NumberTokenizer.from_config,
}
