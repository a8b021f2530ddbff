"""A dikkat tokenizer as a GGUF ``gpt2`` vocabulary: byte-level BPE, written under llama.cpp's
``tokenizer.ggml.*`` keys (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).

What can be written, and how (docs/models.md, "Export to GGUF"):

- the ``bytes`` tokenizer (id = the byte): the 256 byte symbols of GPT-2's byte-level alphabet as
  tokens, in byte order, and no merges — a byte-level BPE that never merges spells every text
  byte by byte, the same ids;
- a byte-level BPE ``tokenizer.json`` (``dikkat train --tokenizer bpe``, GPT-2's own): its tokens
  by id and its merges in rank order; added tokens become control tokens (special) or
  user-defined ones (not special), as llama.cpp's converter marks them.

Anything else — the number words of the translator, a WordPiece, a BPE behind another
pre-tokenizer or a normaliser — has no ``gpt2`` vocabulary that tokenizes the same, and is
refused by name. Rows of the model's embedding past the tokenizer's last id become ``[PADn]``
user-defined tokens, as llama.cpp's converter pads GPT-2-style vocabularies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dikkat.text import ByteTokenizer, HFTokenizer

__all__ = ["GGUFVocab", "byte_symbols", "gguf_vocab"]

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

# the token GPT-2's vocabulary ends a text with; llama.cpp's converter writes it as BOS and EOS
END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class GGUFVocab:
    """What ``tokenizer.ggml.*`` holds: one token and type per id, merges in rank order."""

    tokens: list[str]
    types: list[int]
    merges: list[str]  # "left right", the highest-priority merge first
    bos_id: int | None
    eos_id: int | None


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0…255 (Radford et
    al. 2019, ``bytes_to_unicode`` of openai/gpt-2's ``encoder.py``). Printable Latin-1 bytes
    stand for themselves; the other 68 are moved past 255, in byte order, so that no symbol
    is a space or a control character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    keep = set(printable)
    moved = iter(range(256, 256 + 256 - len(keep)))
    return [chr(b) if b in keep else chr(next(moved)) for b in range(256)]


def gguf_vocab(tokenizer: object, vocab_size: int) -> GGUFVocab:
    """``tokenizer`` (a dikkat run's: :class:`~dikkat.text.ByteTokenizer` or a byte-level BPE
    :class:`~dikkat.text.HFTokenizer`) as a ``gpt2`` vocabulary of ``vocab_size`` ids (the
    model's embedding rows); ``ValueError`` naming what cannot be represented."""
    if isinstance(tokenizer, ByteTokenizer):
        vocab = GGUFVocab(byte_symbols(), [NORMAL] * 256, [], None, None)
    elif isinstance(tokenizer, HFTokenizer):
        vocab = _byte_level_bpe(json.loads(tokenizer.inner.to_str()))  # type: ignore[attr-defined]
    else:
        raise ValueError(
            f"a {type(tokenizer).__name__} has no GGUF 'gpt2' vocabulary: dikkat writes the "
            "'bytes' tokenizer and byte-level BPEs (dikkat train --tokenizer bpe)"
        )
    n = len(vocab.tokens)
    if n > vocab_size:
        raise ValueError(
            f"the tokenizer has {n:,} tokens but the model's embedding only {vocab_size:,} rows: "
            "they do not belong together"
        )
    pads = [f"[PAD{i}]" for i in range(n, vocab_size)]
    return GGUFVocab(
        vocab.tokens + pads,
        vocab.types + [USER_DEFINED] * len(pads),
        vocab.merges,
        vocab.bos_id,
        vocab.eos_id,
    )


def _byte_level_bpe(spec: dict[str, Any]) -> GGUFVocab:
    """A ``tokenizer.json`` (as a dict) that tokenizes as llama.cpp's ``gpt2`` vocabulary with
    pre-tokenizer ``gpt-2`` does: a BPE over GPT-2's byte symbols, cut into words by GPT-2's
    expression first, nothing else in the pipeline."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"a {model.get('type')!r} tokenizer is not a byte-level BPE")
    _refuse(spec.get("normalizer") is not None, "it normalises the text first")
    _refuse(not _is_gpt2_byte_level(spec.get("pre_tokenizer")), "its pre-tokenizer is not GPT-2's")
    decoder = spec.get("decoder") or {}
    _refuse(decoder.get("type") != "ByteLevel", "its decoder is not byte-level")
    for flag in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "unk_token"):
        _refuse(model.get(flag) not in (None, ""), f"its BPE sets {flag}={model.get(flag)!r}")
    for flag in ("byte_fallback", "ignore_merges"):
        _refuse(bool(model.get(flag)), f"its BPE sets {flag}=True")
    processor = spec.get("post_processor")
    _refuse(
        processor is not None and processor.get("type") != "ByteLevel",
        f"its post-processor ({processor and processor.get('type')}) adds tokens to every text",
    )
    by_id: dict[int, str] = {int(i): t for t, i in model.get("vocab", {}).items()}
    added = {int(a["id"]): a for a in spec.get("added_tokens") or ()}
    by_id |= {i: a["content"] for i, a in added.items()}
    n = len(by_id)
    if sorted(by_id) != list(range(n)):
        raise ValueError("the tokenizer's ids are not 0 … n − 1 without gaps: no GGUF vocabulary")
    tokens = [by_id[i] for i in range(n)]
    missing = sorted(set(byte_symbols()) - set(tokens))
    _refuse(bool(missing), f"it lacks {len(missing)} of the 256 byte symbols")
    types = [
        (CONTROL if added[i].get("special") else USER_DEFINED) if i in added else NORMAL
        for i in range(n)
    ]
    merges = []
    for merge in model.get("merges", []):
        pair = merge.split(" ") if isinstance(merge, str) else list(merge)
        _refuse(len(pair) != 2 or not all(pair), f"its merge {merge!r} is not two tokens")
        merges.append(" ".join(pair))
    end = tokens.index(END_OF_TEXT) if END_OF_TEXT in tokens else None
    return GGUFVocab(tokens, types, merges, end, end)


def _is_gpt2_byte_level(pre: dict[str, Any] | None) -> bool:
    """GPT-2's pre-tokenizer: ByteLevel with its expression and no space put before the text
    (alone, or the one step of a Sequence)."""
    if pre is not None and pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        pre = steps[0] if len(steps) == 1 else None
    return (
        pre is not None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )


def _refuse(cannot: bool, why: str) -> None:
    if cannot:
        raise ValueError(
            f"the run's tokenizer cannot be written as a GGUF 'gpt2' vocabulary: {why} (dikkat "
            "writes the 'bytes' tokenizer and byte-level BPEs as GPT-2 has)"
        )
