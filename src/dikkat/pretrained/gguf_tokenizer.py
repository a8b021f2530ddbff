"""A ``tokenizers`` tokenizer rebuilt from a GGUF header's vocabulary (``tokenizer.ggml.*``,
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); :class:`dikkat.pretrained.Tokenizer`
wraps it. Two kinds of vocabulary are read:

* ``gpt2`` — byte-level BPE: the tokens and merges as stored, the text first cut into words by
  the pre-tokenizer that ``tokenizer.ggml.pre`` names (the regular expressions llama.cpp uses
  for each name, ``src/llama-vocab.cpp``, which each family declares with its tokenizers:
  :mod:`dikkat.pretrained.families`; e.g. ``smollm`` splits every digit off before GPT-2's
  expression, as SmolLM2's own ``tokenizer.json`` does; ``qwen2`` composes accents first, as
  Qwen's does).
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

Every value the header gives is checked before anything is built with it: a damaged header is
one ``ValueError`` naming the key, never an error from inside ``tokenizers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from dikkat.pretrained.families import pre_splits
from dikkat.pretrained.families.base import DIGITS_GPT2_SPLIT, GPT2_SPLIT
from dikkat.pretrained.gguf_file import shown
from dikkat.validate import is_int

__all__ = ["gguf_backend"]

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def gguf_backend(metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int | None], int]:
    """The tokenizer a GGUF header describes, with its post-processor (BOS / EOS where the
    header says), the special ids it names (``bos``, ``eos``, ``padding``, ``unknown``, ``eot``,
    ``eom``: None where absent) and the number of tokens."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("the GGUF metadata holds no tokenizer.ggml.tokens list of strings")
    types = metadata.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    if not isinstance(types, list) or not {type(t) for t in types} <= {int}:
        raise ValueError("tokenizer.ggml.token_type is not a list of integers")
    if len(types) != len(tokens):
        raise ValueError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    # every id the header names is an id of the list, before anything is built with it
    ids = {k: _gguf_token_id(metadata, k, len(tokens)) for k in _GGUF_SPECIAL_IDS}
    backend, add_bos = _gguf_backend(metadata, tokens, types)
    _add_special_tokens(backend, tokens, types)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _bos_eos(tokens, ids["bos"], ids["eos"], add_bos, add_eos)
    return backend, ids, len(tokens)


def _gguf_backend(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int]
) -> tuple[Backend, bool]:
    """The BPE of a GGUF vocabulary, and whether its kind starts a text with BOS by default."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre", "default")
        known = pre_splits()  # each family's (dikkat/pretrained/families/)
        if not isinstance(pre, str) or pre not in known:
            raise ValueError(
                f"tokenizer.ggml.pre {shown(pre)} is not a pre-tokenizer dikkat knows; known: "
                f"{sorted(known)}"
            )
        merges = metadata.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise ValueError(
                "a 'gpt2' (byte-level BPE) vocabulary needs tokenizer.ggml.merges, a list of "
                "strings"
            )
        split, whole_words = known[pre].split, known[pre].whole_words
        backend = _byte_level_bpe(tokens, merges, split, whole_words)
        if known[pre].nfc:
            backend.normalizer = normalizers.NFC()
        return backend, whole_words  # Llama 3: BOS
    if kind == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ValueError("a 'llama' (SentencePiece) vocabulary needs one score per token")
        if not all(isinstance(x, (int, float)) and x == x for x in scores):  # x == x: not NaN
            raise ValueError("tokenizer.ggml.scores holds a value that is not a number")
        unk = _gguf_token_id(metadata, "unknown", len(tokens))
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        return _sentencepiece_bpe(tokens, scores, types, unk, prefix), True
    raise ValueError(
        f"tokenizer.ggml.model {shown(kind)} is not supported: dikkat reads 'gpt2' (byte-level "
        "BPE) and 'llama' (SentencePiece BPE) vocabularies"
    )


def _byte_level_bpe(tokens: list[str], merges: list[str], split: str, whole_words: bool) -> Backend:
    pairs = []
    for k, merge in enumerate(merges):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"tokenizer.ggml.merges[{k}] = {shown(merge)} is not two tokens")
        pairs.append((pair[0], pair[1]))
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        backend = Backend(BPE(vocab, pairs, ignore_merges=whole_words))
    except Exception as e:  # tokenizers raises a bare Exception ("Error while initializing BPE")
        for k, (left, right) in enumerate(pairs):  # which merge: a token the list lacks
            lacking = [t for t in (left, right, left + right) if t not in vocab]
            if lacking:
                raise ValueError(
                    f"tokenizer.ggml.merges[{k}] = {shown(merges[k])} needs the token "
                    f"{shown(lacking[0])}, which tokenizer.ggml.tokens ({len(tokens)} tokens) "
                    "lacks"
                ) from None
        raise ValueError(f"tokenizer.ggml.tokens and merges make no BPE: {e}") from None
    if split in (GPT2_SPLIT, DIGITS_GPT2_SPLIT):
        words = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        digits = (
            [pre_tokenizers.Digits(individual_digits=True)] if split == DIGITS_GPT2_SPLIT else []
        )
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
    unk_token = None if unk is None else tokens[unk]  # an id of the list (from_gguf_metadata)
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


# the ids a GGUF header may name: tokenizer.ggml.{name}_token_id
_GGUF_SPECIAL_IDS = ("bos", "eos", "padding", "unknown", "eot", "eom")


def _gguf_token_id(metadata: Mapping[str, Any], name: str, n: int) -> int | None:
    """``tokenizer.ggml.{name}_token_id``: None where absent, else an id of the ``n`` tokens."""
    key = f"tokenizer.ggml.{name}_token_id"
    value = metadata.get(key)
    if value is not None and not (is_int(value) and 0 <= value < n):
        raise ValueError(f"{key} = {shown(value)} is not a token id of the {n} tokens")
    return value
