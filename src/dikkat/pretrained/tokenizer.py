"""Text ↔ token ids for a pretrained decoder, from a GGUF file's vocabulary or an HF folder.

A GGUF file carries no ``tokenizer.json``: its header holds the vocabulary under llama.cpp's keys
(``tokenizer.ggml.*``, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), and
:meth:`Tokenizer.from_gguf_metadata` rebuilds a ``tokenizers`` (Hugging Face) tokenizer from them:

* ``gpt2`` — byte-level BPE: the tokens and merges as stored, the text first cut into words by
  the pre-tokenizer that ``tokenizer.ggml.pre`` names (the regular expressions llama.cpp uses
  for each name, ``src/llama-vocab.cpp``; e.g. ``smollm`` splits every digit off before GPT-2's
  expression, as SmolLM2's own ``tokenizer.json`` does).
* ``llama`` — SentencePiece BPE (Llama 2, Mistral, Gemma): merges are not stored, so they are
  rebuilt from the scores — a pair is merged when both halves and their concatenation are
  normal tokens, higher-scoring results first, which is the order SentencePiece and llama.cpp
  merge in; spaces are written ``▁``; a character outside the vocabulary is spelled by its UTF-8
  bytes (the ``<0xXX>`` tokens); a ``▁`` goes before the text only when
  ``tokenizer.ggml.add_space_prefix`` says so (Gemma: no).

In both, the control tokens (GGUF token type 3: ``<|im_start|>``, ``<bos>``, ``<end_of_turn>``)
and the user-defined ones (type 4: Gemma's runs of ``\\n``, ``\\t`` and spaces, HTML tags) are
matched whole in the text before the BPE sees it, as llama.cpp does; ``decode(...,
skip_special=True)`` leaves the control tokens out.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from dikkat.pretrained.chat_template import hf_chat_template

__all__ = ["END_OF_TURN_TOKENS", "Tokenizer"]

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

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

# Pre-tokenizer expressions by tokenizer.ggml.pre (llama.cpp's names and expressions).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2, _DIGITS_GPT2 = "gpt2", "digits+gpt2"  # GPT-2's expression; every digit split off first
# name → (the expression, or one of the two above; whether a word that is a token is taken whole)
_PRE: dict[str, tuple[str, bool]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo"), (_GPT2, False)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (_DIGITS_GPT2, False),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), (_LLAMA3_SPLIT, True)
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), (_LLAMA3_SPLIT, False)),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), (_QWEN2_SPLIT, False)),
    "tekken": (_TEKKEN_SPLIT, False),
}


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
        return self.backend.encode(text, add_special_tokens=add_special).ids

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
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError("the GGUF metadata holds no tokenizer.ggml.tokens list of strings")
        types = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )
        backend, add_bos = _gguf_backend(metadata, tokens, types)
        _add_special_tokens(backend, tokens, types)
        key = "tokenizer.ggml.{}_token_id".format
        bos, eos = metadata.get(key("bos")), metadata.get(key("eos"))
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos(tokens, bos, eos, add_bos, add_eos)
        return cls(
            backend,
            bos_id=bos,
            eos_id=eos,
            pad_id=metadata.get(key("padding")),
            unk_id=metadata.get(key("unknown")),
            extra_eos=[i for k in ("eot", "eom") if (i := metadata.get(key(k))) is not None],
            vocab_size=len(tokens),
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


def _gguf_backend(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int]
) -> tuple[Backend, bool]:
    """The BPE of a GGUF vocabulary, and whether its kind starts a text with BOS by default."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE:
            raise ValueError(
                f"tokenizer.ggml.pre {pre!r} is not a pre-tokenizer dikkat knows; known: "
                f"{sorted(_PRE)}"
            )
        merges = metadata.get("tokenizer.ggml.merges")
        if not isinstance(merges, list):
            raise ValueError("a 'gpt2' (byte-level BPE) vocabulary needs tokenizer.ggml.merges")
        split, whole_words = _PRE[pre]
        return _byte_level_bpe(tokens, merges, split, whole_words), whole_words  # Llama 3: BOS
    if kind == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ValueError("a 'llama' (SentencePiece) vocabulary needs one score per token")
        unk = metadata.get("tokenizer.ggml.unknown_token_id")
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        return _sentencepiece_bpe(tokens, scores, types, unk, prefix), True
    raise ValueError(
        f"tokenizer.ggml.model {kind!r} is not supported: dikkat reads 'gpt2' (byte-level BPE) "
        "and 'llama' (SentencePiece BPE) vocabularies"
    )


def _byte_level_bpe(tokens: list[str], merges: list[str], split: str, whole_words: bool) -> Backend:
    pairs = []
    for k, merge in enumerate(merges):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"tokenizer.ggml.merges[{k}] = {merge!r} is not two tokens")
        pairs.append((pair[0], pair[1]))
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(BPE(vocab, pairs, ignore_merges=whole_words))
    if split in (_GPT2, _DIGITS_GPT2):
        words = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        digits = [pre_tokenizers.Digits(individual_digits=True)] if split == _DIGITS_GPT2 else []
        backend.pre_tokenizer = pre_tokenizers.Sequence([*digits, words])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], unk: int | None, prefix: bool
) -> Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, kind in zip(tokens, types, strict=True) if kind == _NORMAL}
    # SentencePiece merges the adjacent pair whose union scores highest: a merge's rank is its
    # result's score (ties: the lower id first)
    order = [i for i, kind in enumerate(types) if kind == _NORMAL]
    order.sort(key=lambda i: (-scores[i], i))
    merges: list[tuple[str, str]] = []
    is_normal, add = normal.__contains__, merges.append  # 1.8 M look-ups for Gemma 3: kept tight
    for i in order:
        token = tokens[i]
        for k in range(1, len(token)):
            if is_normal(left := token[:k]) and is_normal(right := token[k:]):
                add((left, right))
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    model = BPE(vocab, merges, unk_token=unk_token, byte_fallback=True, fuse_unk=True)
    backend = Backend(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens: both are
    then matched whole in the raw text (before any normalisation), longest first."""
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _bos_eos(
    tokens: list[str], bos: Any, eos: Any, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """A post-processor that puts BOS before and EOS after a text where the header says so."""
    single, special = ["$A"], {}
    for name, wanted, id_ in (("bos", add_bos, bos), ("eos", add_eos, eos)):
        if not wanted:
            continue
        if not (isinstance(id_, int) and 0 <= id_ < len(tokens)):
            raise ValueError(
                f"tokenizer.ggml.add_{name}_token is set, but the {name} id is {id_!r}"
            )
        single.insert(0 if name == "bos" else len(single), tokens[id_])
        special[tokens[id_]] = id_
    return processors.TemplateProcessing(single=single, special_tokens=list(special.items()))


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
