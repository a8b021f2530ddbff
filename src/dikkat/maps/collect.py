"""Running a model under :func:`dikkat.capture` and keeping what it saw as
:class:`~dikkat.viz.maps.AttentionMaps`.

Notation: ``L`` layers kept, ``h`` heads kept, ``r`` query rows kept, ``S`` keys.

Only the selected layers, heads and query rows are ever recomputed (docs/hf.md, "Attention
weights"): a map of one row of a 4096-token input holds 4096 weights per head, never 4096².
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dikkat.core.capture import attention_layers, capture
from dikkat.viz.maps import AttentionMaps

__all__ = ["Selection", "collect", "find_token", "layer_family", "pick", "token_labels"]

Selection = Sequence[int] | int | None  # indices (negative from the end), one index, or all


def layer_family(model: nn.Module, suffix: str = "") -> list[str]:
    """The names of ``model``'s attention layers (:func:`dikkat.attention_layers`) ending in
    ``suffix`` — ``".cross_attn"`` keeps a translator's cross-attention; "" keeps them all."""
    names = [name for name, _ in attention_layers(model) if name.endswith(suffix)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no attention layers named '…{suffix}'")
    return names


def pick(name: str, chosen: Selection, n: int) -> list[int]:
    """Sorted, distinct indices into ``n`` things, negatives from the end."""
    if chosen is None:
        return list(range(n))
    values = [chosen] if isinstance(chosen, int) else list(chosen)
    if not values or any(isinstance(i, bool) or not isinstance(i, int) for i in values):
        raise ValueError(f"{name} must be ints, got {chosen!r}")
    bad = [i for i in values if not -n <= i < n]
    if bad:
        raise ValueError(f"{name} {bad} do not exist: there are {n} ({name} 0 … {n - 1})")
    return sorted({i % n for i in values})


def collect(
    model: nn.Module,
    run: Callable[[], Any],
    *,
    family: Sequence[str],
    queries: Sequence[str],
    keys: Sequence[str],
    layers: Selection = None,
    heads: Selection = None,
    rows: Selection = None,
    kind: str = "self",
    title: str = "",
) -> AttentionMaps:
    """Call ``run()`` (one forward of ``model`` on one input) with the chosen layers of
    ``family`` captured, and return their weights.

    Args:
        family: attention layer names (:func:`layer_family`); ``layers`` index this list and
            the maps' layer labels count in it ("layer 0" is ``family[0]``).
        queries, keys: a label per query position and per key of the captured calls.
        heads, rows: the heads and query rows to keep (negative from the end); None: all.
    """
    chosen = pick("layers", layers, len(family))
    names = [family[i] for i in chosen]
    with capture(model, layers=names, heads=heads, rows=rows) as cap, torch.no_grad():
        run()
    calls = [cap[name] for name in names]  # (1, h, r, S) each
    first = next(c for c in cap.calls if c.layer == names[0])
    if calls[0].shape[0] != 1:
        raise ValueError(f"collect draws one input at a time, the forward ran a batch of "
                         f"{calls[0].shape[0]}")  # fmt: skip
    if len(queries) <= max(first.rows) or len(keys) != calls[0].shape[-1]:
        raise ValueError(
            f"{len(queries)} query and {len(keys)} key labels for calls of "
            f"{tuple(calls[0].shape)} (B, heads, rows, keys)"
        )
    weights = torch.stack([c[0] for c in calls]).float().cpu().numpy()  # (L, h, r, S)
    return AttentionMaps(
        queries=tuple(queries[i] for i in first.rows),
        keys=tuple(keys),
        layers=tuple(f"layer {i}" for i in chosen),
        heads=first.heads,
        weights=weights,
        rows=first.rows,
        kind=kind,
        title=title,
    )


def find_token(tokens: Sequence[str], token: str | int) -> int:
    """The position of ``token`` in ``tokens``: an int is a position (negative from the end);
    a str the first token equal to it, else the first equal ignoring case and the word-piece
    marks (``##``, ``Ġ``, ``▁``, ``␣``)."""
    n = len(tokens)
    if isinstance(token, int) and not isinstance(token, bool):
        if not -n <= token < n:
            raise ValueError(f"token index {token} is out of range for the {n} tokens")
        return token % n
    if not isinstance(token, str):
        raise TypeError(f"token must be a str or an int, got {type(token).__name__}")
    if token in tokens:
        return list(tokens).index(token)

    def bare(t: str) -> str:
        return t.removeprefix("##").lstrip("Ġ▁␣ ").lower()

    for i, t in enumerate(tokens):
        if bare(t) == bare(token):
            return i
    raise ValueError(f"token {token!r} is not among the {n} tokens: {list(tokens)}")


def _byte_label(i: int) -> str:
    c = chr(i)
    if c == " ":
        return "␣"
    if c == "\n":
        return "\\n"
    return c if c.isprintable() and i < 128 else f"\\x{i:02x}"


def token_labels(tokenizer: Any, ids: Sequence[int]) -> tuple[str, ...]:
    """A label per id: a ``tokenizers`` vocabulary's token (``[CLS]``, ``##ing``; byte-level
    BPE's ``Ġ`` shown as ``␣``), a number-words token, or a byte (a space is ``␣``)."""
    inner = getattr(tokenizer, "inner", tokenizer)
    if hasattr(inner, "id_to_token"):
        out = []
        for i in ids:
            t = inner.id_to_token(int(i))
            if t is None:
                out.append(f"<{i}>")
            else:  # byte-level BPE's Ġ and SentencePiece's ▁ are spaces
                out.append(t.replace("Ġ", "␣").replace("▁", "␣").replace("Ċ", "\\n"))
        return tuple(out)
    table = getattr(tokenizer, "tokens", None)
    if table is not None:
        return tuple(table[int(i)] if 0 <= int(i) < len(table) else f"<{i}>" for i in ids)
    return tuple(_byte_label(int(i)) if 0 <= int(i) < 256 else f"<{i}>" for i in ids)
