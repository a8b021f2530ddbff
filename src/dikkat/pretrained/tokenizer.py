"""Text ↔ token ids for a pretrained decoder, from a GGUF file's vocabulary or an HF folder.

A GGUF file carries no ``tokenizer.json``: :mod:`dikkat.pretrained.gguf_tokenizer` rebuilds a
``tokenizers`` (Hugging Face) tokenizer from its header's ``tokenizer.ggml.*`` keys; an HF folder's
``tokenizer.json`` is read as it is. Either way :class:`Tokenizer` wraps it with the model's
special ids.

``encode`` runs the ``tokenizers`` library's batch call for one text, which releases the GIL
while it works (its single-text ``encode`` holds it): a server tokenising a long prompt in a
worker thread keeps answering on its event loop.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from dikkat.pretrained.chat_template import hf_chat_template
from dikkat.pretrained.gguf_tokenizer import gguf_backend

__all__ = ["END_OF_TURN_TOKENS", "Tokenizer"]

# Tokens that close a turn or a document in the common chat and training formats; a generation
# ends at any of them that the vocabulary holds, as well as at EOS (llama.cpp's end-of-generation
# list, src/llama-vocab.cpp). Stopping there is right for every format: none of them means text.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML (SmolLM2, Qwen)
    "<end_of_turn>",  # Gemma
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3.1, end of a tool call message
    "<|end|>",  # Phi-3
    "<|endoftext|>",  # GPT-2 style document end (SmolLM2, Qwen)
    "<|end_of_text|>",  # Llama 3 base, Granite
    "<EOT>",  # CodeLlama infill
)


class Tokenizer:
    """Text → ids (:meth:`encode`) and back (:meth:`decode`), with the model's special ids.

    ``backend`` is a ``tokenizers.Tokenizer``; its post-processor adds BOS (EOS) where the model
    wants them, which ``add_bos`` (``add_eos``) reports. ``eos_ids`` are the ids that end a
    generation: EOS, any of :data:`END_OF_TURN_TOKENS` the vocabulary holds, and ``extra_eos`` (a
    model's ``generation_config.json`` may name more).

    >>> tok = Tokenizer.from_gguf_metadata(GGUFFile("SmolLM2-135M-Instruct.Q4_1.gguf").metadata)
    >>> tok.encode("Hello world")  # doctest: +SKIP
    [19556, 905]
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        extra_eos: Iterable[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size()
        self.bos_id = None if bos_id is None else self._checked_id("bos_id", bos_id)
        self.eos_id = None if eos_id is None else self._checked_id("eos_id", eos_id)
        self.pad_id = None if pad_id is None else self._checked_id("pad_id", pad_id)
        self.unk_id = None if unk_id is None else self._checked_id("unk_id", unk_id)
        front, back = _post_processor_ids(backend)
        self.add_bos = front == [self.bos_id]
        self.add_eos = back == [self.eos_id]
        ends = {self.eos_id} if self.eos_id is not None else set()
        ends |= {self._checked_id(f"extra_eos[{k}]", i) for k, i in enumerate(extra_eos)}
        ends |= {i for t in END_OF_TURN_TOKENS if (i := backend.token_to_id(t)) is not None}
        self.eos_ids: frozenset[int] = frozenset(ends)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.vocab_size} tokens, bos {self.bos_token!r}, eos {self.eos_token!r}"
            f"{', adds BOS' if self.add_bos else ''}, ends at {sorted(self.eos_ids)})"
        )

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.id_to_token(self.eos_id)

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """The ids of ``text``; special tokens written in it (``<|im_start|>``) are matched whole.
        ``add_special`` adds BOS / EOS where the model's tokenizer says so (a chat template writes
        them itself: encode its output with ``add_special=False``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode_batch([text], add_special_tokens=add_special)[0].ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of ``ids``; ``skip_special`` leaves the control tokens out. A character cut off
        at the end (its bytes span ids) decodes to U+FFFD, which dikkat's ``TextStream`` holds back
        until the next id completes it."""
        ids = [self._checked_id(f"ids[{k}]", i) for k, i in enumerate(ids)]
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def id_to_token(self, id_: int) -> str:
        """The vocabulary's spelling of one id (``Ġthe``, ``▁the``, ``<0x0A>``)."""
        token = self.backend.id_to_token(self._checked_id("id", id_))
        if token is None:
            raise ValueError(f"id {id_} is in the vocabulary's range but names no token")
        return token

    def token_to_id(self, token: str) -> int | None:
        """The id of a token in the vocabulary's spelling, or None when there is none."""
        return self.backend.token_to_id(token)

    def _checked_id(self, name: str, value: Any) -> int:
        """``value`` as a Python int, refused unless it is an integer id of this vocabulary."""
        if isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
        try:
            value = operator.index(value)  # numpy and torch integers too
        except TypeError:
            raise TypeError(f"{name} must be an int, got {value!r}") from None
        if not 0 <= value < self.vocab_size:
            raise ValueError(f"{name} = {value} is outside the vocabulary [0, {self.vocab_size})")
        return value

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF header describes (:attr:`GGUFFile.metadata`). It encodes as
        transformers' GGUF tokenizer does, except where that departs from the model's own
        tokenizer and llama.cpp: ``smollm``'s digits, Gemma's runs of 32 or more spaces, and a
        ``llama`` vocabulary's ``add_space_prefix = False`` (tests/pretrained/test_tokenizer.py)."""
        backend, ids, n = gguf_backend(metadata)
        return cls(
            backend,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["padding"],
            unk_id=ids["unknown"],
            extra_eos=[i for k in ("eot", "eom") if (i := ids[k]) is not None],
            vocab_size=n,
        )

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        config: Mapping[str, Any] | None = None,
        *,
        extra_eos: Iterable[int] = (),
    ) -> Tokenizer:
        """A ``tokenizer.json`` and the special tokens its ``tokenizer_config.json`` names
        (``config``: ``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``). BOS and EOS are
        added where the file's post-processor adds them, as transformers 5 does: the config's
        ``add_bos_token`` is not read (the two agree in the models' own folders)."""
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"{path} is not a readable tokenizer.json: {e}") from None
        config = dict(config or {})
        ids = {
            name: _config_token_id(backend, config, name, path)
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        return cls(
            backend,
            bos_id=ids["bos_token"],
            eos_id=ids["eos_token"],
            pad_id=ids["pad_token"],
            unk_id=ids["unk_token"],
            extra_eos=extra_eos,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> tuple[Tokenizer, str | None]:
        """The tokenizer of a Hugging Face model folder (``tokenizer.json``,
        ``tokenizer_config.json``, and the end-of-generation ids of ``generation_config.json``)
        and its chat template (:func:`~dikkat.pretrained.chat_template.hf_chat_template`)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder} holds no tokenizer.json")
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        extra = generation.get("eos_token_id") or []
        extra = [extra] if isinstance(extra, int) else list(extra)
        tokenizer = cls.from_file(folder / "tokenizer.json", config, extra_eos=extra)
        return tokenizer, hf_chat_template(folder, config)


def _post_processor_ids(backend: Backend) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a text."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return full[:k], full[k + len(plain) :]
    return [], []


def _config_token_id(backend: Backend, config: dict, name: str, path: str | Path) -> int | None:
    token = config.get(name)
    if isinstance(token, dict):  # an AddedToken written out: {"content": "<s>", ...}
        token = token.get("content")
    if token is None:
        return None
    if not isinstance(token, str):
        raise ValueError(f"{name} in the tokenizer config must be a string, got {token!r}")
    id_ = backend.token_to_id(token)
    if id_ is None:
        raise ValueError(f"{name} {token!r} of the tokenizer config is not in {path}")
    return id_


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data
