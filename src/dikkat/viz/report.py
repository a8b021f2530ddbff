"""An interactive attention report in one HTML file: a head view and a model view.

Notation: ``L`` layers, ``H`` heads, ``Tq`` query rows, ``Tk`` keys (as in
:class:`~dikkat.viz.maps.AttentionMaps`).

The file holds everything it needs — the weights as JSON, the script and the style sheet, inline —
so it opens offline from disk (``file://``), with no server and no network. What the views show,
and the size limit, are described in docs/report.md.

Weights are stored as integers in units of 1/10 000 (:data:`SCALE`), four decimal places, which
keeps a file about a third the size of printed floats. Token text reaches the page only as JSON
(with ``<``, ``>`` and ``&`` escaped, so no label can close the ``<script>`` element) and is put
into the page by the script with ``textContent``, so a label such as ``<script>`` shows as text.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from dikkat.files import write_text
from dikkat.viz.maps import AttentionMaps

__all__ = ["MAX_BYTES", "SCALE", "write_html"]

SCALE = 10_000  # a weight w is stored as round(w * SCALE): four decimal places
MAX_BYTES = 32 * 2**20  # larger files open slowly, and the head view would draw too many lines

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>
{css}</style>
</head>
<body>
<script type="application/json" id="dikkat-data">{data}</script>
<main>
<h1 id="title"></h1>
<p class="note" id="kind"></p>
<h2>Head view</h2>
<p class="note">A line from each query to each key it attends to; its opacity is the weight (below
0.01 not drawn), its colour the head. Pick a token in the menu or click it to keep only its lines
(click it again, or pick "every token", for all); hover a token to single out its lines.</p>
<div class="controls"><label>layer <select id="layer"></select></label><label>token <select
id="token"></select></label><span class="mode" role="radiogroup" aria-label="heads shown">heads:
<label><input type="radio" name="head-mode" value="all"> all</label><label><input type="radio"
name="head-mode" value="one"> one</label><label><input type="radio" name="head-mode"
value="none"> none</label></span><span id="heads" class="controls"></span></div>
<svg id="head-view" class="head-view" role="img" aria-label="head view"></svg>
<h2>Heat map</h2>
<p class="note"><span id="heat-title"></span>: row = query, column = key, white 0, the head's
full colour 1; hover a cell for its weight.</p>
<svg id="heat-map" class="heat-map" role="img" aria-label="heat map"></svg>
<h2>Model view</h2>
<p class="note">A heat map per layer and head, on the same scale. Click one to show it in the head
view and the heat map above.</p>
<div id="model-view" class="grid"></div>
</main>
<script>
{js}</script>
</body>
</html>
"""


def _asset(name: str) -> str:
    return resources.files("dikkat.viz").joinpath(name).read_text(encoding="utf-8")


def _script_safe_json(payload: dict[str, Any]) -> str:
    """JSON that can sit inside ``<script>``: ``<``, ``>`` and ``&`` only occur inside strings
    in JSON, where ``\\u003c`` etc. mean the same character, so ``</script>`` or ``<!--`` in a
    label can never end the element early. ``ensure_ascii`` keeps odd code points (a lone
    surrogate from a byte-level tokenizer) writable as UTF-8."""
    text = json.dumps(payload, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < 2**20 else f"{n / 2**20:.1f} MB"


def _refuse_if_too_big(size: int, maps: AttentionMaps, max_bytes: int) -> None:
    if size > max_bytes:
        L, H, Tq, Tk = maps.weights.shape
        raise ValueError(
            f"the HTML report would be {_size(size)} ({L} layers × {H} heads × {Tq} × {Tk} "
            f"weights), over the limit of {_size(max_bytes)} (max_bytes={max_bytes}); keep fewer "
            "layers or heads (dikkat show --layer/--head) or fewer tokens"
        )


def _index(name: str, value: object, n: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -n <= value < n:
        raise ValueError(f"{name} must be an index into the {n} {what}, got {value!r}")
    return value % n


def _opened(
    maps: AttentionMaps, focus: int | None, layer: int, heads: Sequence[int] | None
) -> dict[str, Any]:
    """The view the page opens on, as indices into the maps' axes (checked)."""
    L, H, Tq, _ = maps.weights.shape
    shown = list(range(H))
    if heads is not None:
        if isinstance(heads, (str, bytes)) or not all(isinstance(h, int) for h in heads):
            raise TypeError(f"heads must be a sequence of head numbers, got {heads!r}")
        unknown = [h for h in heads if h not in maps.heads]
        if unknown:
            raise ValueError(f"heads {unknown} are not among the maps' heads {list(maps.heads)}")
        shown = [i for i, h in enumerate(maps.heads) if h in heads]
    return {
        "focus": None if focus is None else _index("focus", focus, Tq, "query rows"),
        "layer": _index("layer", layer, L, "layers"),
        "heads": shown,
    }


def write_html(
    maps: AttentionMaps,
    path: str | Path,
    *,
    title: str | None = None,
    focus: int | None = None,
    layer: int = 0,
    heads: Sequence[int] | None = None,
    max_bytes: int = MAX_BYTES,
) -> Path:
    """Write ``maps`` as one self-contained, interactive HTML file at ``path`` (atomically: the
    old file stays whole until the new one is complete). Returns the path.

    The page has a head view (query tokens on the left, keys on the right, a line from each
    query to each key it attends to, its opacity the weight, one colour per head; a layer menu,
    a token menu, head check boxes with "all", "one" and "none", hovering a token singles out
    its lines), a heat map of one layer and head with the tokens along its axes, and a model
    view (a small heat map per layer and head; clicking one shows it in the two views above).

    What the page opens on: ``focus``, a query row (an index into ``maps.queries``, negative
    from the end; None: every token's lines), ``layer`` (an index into ``maps.layers``) and
    ``heads``, the head numbers of ``maps.heads`` shown (None: all).

    ``title`` replaces ``maps.title``. A report larger than ``max_bytes`` is refused with a
    ``ValueError`` naming its size, before anything is written.
    """
    if not isinstance(maps, AttentionMaps):
        raise TypeError(f"maps must be an AttentionMaps, got {type(maps).__name__}")
    if min(maps.weights.shape) == 0:
        raise ValueError(f"maps has nothing to draw: weights of shape {maps.weights.shape}")
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    opened = _opened(maps, focus, layer, heads)
    L, H, Tq, Tk = maps.weights.shape
    q = np.rint(np.clip(maps.weights, 0.0, 1.0) * SCALE).astype(np.int32)  # (L, H, Tq, Tk)
    # the bytes the weights alone take (digits and commas), known before building any text
    digits = 1 + (q >= 10).astype(np.int64) + (q >= 100) + (q >= 1000) + (q >= 10_000)
    _refuse_if_too_big(int(digits.sum()) + q.size, maps, max_bytes)

    name = maps.title if title is None else str(title)
    payload = {
        "title": name,
        "kind": maps.kind,
        "queries": [str(t) for t in maps.queries],
        "keys": [str(t) for t in maps.keys],
        "layers": [str(t) for t in maps.layers],
        "heads": [int(h) for h in maps.heads],
        "head_labels": list(maps.head_labels),  # "head 3", or "mean of heads" for a rollout
        "rows": [int(r) for r in maps.query_positions],
        "open": opened,  # what the page shows first: {"focus", "layer", "heads"} (indices)
        "scale": SCALE,
        "weights": q.reshape(L, H, Tq * Tk).tolist(),  # [layer][head][i * Tk + j]
    }
    page = PAGE.format(
        title=html.escape(name or "attention"),
        css=_asset("report.css"),
        data=_script_safe_json(payload),
        js=_asset("report.js"),
    )
    _refuse_if_too_big(len(page.encode("utf-8")), maps, max_bytes)
    path = Path(path)
    write_text(path, page)
    return path
