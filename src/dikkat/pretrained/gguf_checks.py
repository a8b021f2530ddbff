"""The checks a GGUF header's model sizes pass before a model is built from them
(docs/models.md, "What a load checks").

A header is data from the file, like the tensors: a size is read only as an integer of the
right range (a string, a list, a float or a bool is refused by key), and is held against the
tensors the file really holds before anything sized by it is built — ``block_count`` against
the blocks whose tensors are present (10⁹ is refused at once, not after building 10⁹ names), the
widths, head counts and vocabulary against the shapes of the tensors they describe. A
disagreement is one ``ValueError`` naming the file, the key or tensor, and the values.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from dikkat.pretrained.gguf_file import shown

__all__ = [
    "MAX_SIZE",
    "block_count",
    "check_shape",
    "header_float",
    "header_int",
    "vocab_rows",
]

# The largest size a header may give: llama.cpp reads its hyper-parameters into 32-bit integers
# (src/llama-hparams.h), so no file it runs says more.
MAX_SIZE = 2**31 - 1
_BLOCK = re.compile(r"blk\.(\d+)\.")
_REQUIRED = object()


def header_int(
    meta: Mapping[str, Any], key: str, source: str, *, default: Any = _REQUIRED, at_least: int = 1
) -> int:
    """Header value ``key``: an integer in [``at_least``, :data:`MAX_SIZE`] (``default`` where
    the header lacks it; without one, the key is required)."""
    value = meta.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"{source}: the GGUF header has no {key}")
    if isinstance(value, bool) or not isinstance(value, int) or not at_least <= value <= MAX_SIZE:
        raise ValueError(
            f"{source}: {key} = {shown(value)}, where an integer in [{at_least}, {MAX_SIZE}] "
            "belongs"
        )
    return value


def header_float(
    meta: Mapping[str, Any], key: str, source: str, *, default: Any = _REQUIRED
) -> float:
    """Header value ``key``: a finite number > 0 (an epsilon, a RoPE base)."""
    value = meta.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"{source}: the GGUF header has no {key}")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: {key} = {shown(value)}, where a finite number > 0 belongs")
    return float(value)


def block_count(meta: Mapping[str, Any], key: str, names: Any, source: str) -> int:
    """``key`` (``llama.block_count``): as many as the blocks whose tensors (``blk.N.…``) the
    file holds."""
    n = header_int(meta, key, source)
    blocks = {int(m.group(1)) for name in names if (m := _BLOCK.match(name))}
    if n != len(blocks):
        held = f"blk.0 … blk.{max(blocks)}" if blocks else "none"
        raise ValueError(
            f"{source}: {key} = {n}, but the file holds the tensors of {len(blocks)} blocks "
            f"({held})"
        )
    return n


def vocab_rows(
    meta: Mapping[str, Any],
    arch: str,
    shapes: Mapping[str, Any],
    source: str,
    embedding_name: str = "token_embd.weight",
) -> int:
    """The vocabulary size, which the header's ``{arch}.vocab_size`` (where given), the token
    list and the token embedding's rows (tensor ``embedding_name``) must all agree on: a token
    id is a row."""
    embedding = shapes.get(embedding_name)
    if embedding is None or len(embedding) != 2:
        raise ValueError(f"{source} holds no {embedding_name} matrix")
    rows = embedding[0]
    key = f"{arch}.vocab_size"
    if key in meta and header_int(meta, key, source) != rows:
        raise ValueError(
            f"{source}: {key} = {meta[key]}, but {embedding_name} has {rows} rows, one a token "
            "id: the header and the embedding disagree"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ValueError(f"{source}: the GGUF header holds no tokenizer.ggml.tokens list")
    if len(tokens) != rows:
        raise ValueError(
            f"{source}: tokenizer.ggml.tokens holds {len(tokens)} tokens, but {embedding_name} "
            f"has {rows} rows, one a token id: the vocabulary and the embedding disagree"
        )
    return rows


def check_shape(
    shapes: Mapping[str, tuple[int, ...]], name: str, want: tuple[int, ...], why: str, source: str
) -> None:
    """Tensor ``name`` (where the file holds it: a missing one is named elsewhere) is of torch
    shape ``want``, which ``why`` (the keys that imply it) explains."""
    found = shapes.get(name)
    if found is not None and tuple(found) != tuple(want):
        raise ValueError(
            f"{source}: tensor {shown(name)} is {tuple(found)}, but {why} make it {tuple(want)}"
        )
