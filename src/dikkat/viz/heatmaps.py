"""Heat maps of :class:`~dikkat.viz.maps.AttentionMaps`: the grid of layers × heads, where one
token looks in each head, and a cross-attention alignment.

Notation: ``L`` layers, ``H`` heads, ``Tq`` query rows, ``Tk`` keys.

Each function returns the matplotlib ``Figure`` unsaved, so its panels, labels and title can be
read back; :func:`dikkat.viz.figure.save_png` writes it. Every map is drawn on its own colour
scale (from 0 to its largest weight): a head that spreads its weight thinly is still visible
beside one that puts 0.9 on ``[CLS]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dikkat.viz.figure import fit_layout
from dikkat.viz.maps import AttentionMaps

__all__ = ["draw_alignment", "draw_focus", "draw_grid", "label_size", "tick_step"]

CMAP = "magma"
POINTS_PER_INCH = 72
MIN_WIDTH = 4.0  # inches: a grid of one column (a rollout) still has room for its title
FOCUS_COLUMNS = 6  # layers a row of the focus picture holds


def pyplot() -> Any:
    """matplotlib.pyplot on its file backend (no screen)."""
    import matplotlib  # lazily: slow to import, and only pictures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_size(n: int, inches: float) -> float:
    """The font size (points) for ``n`` token labels along ``inches`` of axis: as large as fits
    one label per token, between 4 and 9 points (past that, :func:`tick_step` thins them)."""
    return float(min(9.0, max(4.0, inches * POINTS_PER_INCH / (1.3 * max(n, 1)))))


def tick_step(n: int, inches: float, size: float) -> int:
    """Label every ``step``-th token so that labels of ``size`` points do not overlap."""
    fits = max(1, int(inches * POINTS_PER_INCH / (1.25 * size)))
    return max(1, math.ceil(n / fits))


def escape(label: str) -> str:
    """A token drawn as itself: matplotlib reads ``$…$`` as mathematics."""
    return label.replace("$", r"\$")


def label_axis(ax: Any, axis: str, labels: Sequence[str], inches: float) -> None:
    """Token labels along ``axis`` ("x" or "y") of ``inches``: sized and thinned to fit."""
    n = len(labels)
    size = label_size(n, inches)
    step = tick_step(n, inches, size)
    where = list(range(0, n, step))
    shown = [escape(labels[i]) for i in where]
    if axis == "x":
        ax.set_xticks(where)
        ax.set_xticklabels(shown, rotation=90, fontsize=size)
    else:
        ax.set_yticks(where)
        ax.set_yticklabels(shown, fontsize=size)


def _panel(ax: Any, w: np.ndarray) -> None:
    ax.imshow(w, cmap=CMAP, vmin=0.0, vmax=max(float(w.max()), 1e-12), aspect="auto",
              interpolation="nearest")  # fmt: skip
    ax.tick_params(length=1.5, pad=1)


def _no_ticks(ax: Any, axis: str) -> None:
    (ax.set_xticks if axis == "x" else ax.set_yticks)([])


def draw_grid(maps: AttentionMaps, *, panel: float = 1.6) -> Any:
    """One heat map per kept layer (rows of the grid) and head (columns): query rows down, keys
    across, the keys labelled under the bottom row and the queries beside the left column.

    Args:
        maps: what to draw.
        panel: the width of one map, in inches (its height follows the rows' share of keys).
    """
    plt = pyplot()
    L, H, Tq, Tk = maps.weights.shape
    height = panel * min(max(Tq / Tk, 0.25), 1.5)
    margin = 0.9  # inches for the token labels
    width = max(H * panel + margin + 0.3, MIN_WIDTH)  # room for the title above one column
    fig, axes = plt.subplots(
        L,
        H,
        figsize=(width, L * (height + 0.3) + margin + 0.5),
        dpi=100,
        squeeze=False,
    )
    heads = maps.head_labels
    for li in range(L):
        for hi in range(H):
            ax = axes[li, hi]
            _panel(ax, maps.weights[li, hi])
            ax.set_title(f"{maps.layers[li]} · {heads[hi]}", fontsize=6, pad=2)
            if li == L - 1:
                label_axis(ax, "x", maps.keys, panel)
            else:
                _no_ticks(ax, "x")
            if hi == 0:
                label_axis(ax, "y", maps.queries, height)
            else:
                _no_ticks(ax, "y")
    what = "each map on its own scale; rows: queries, columns: keys"
    fit_layout(fig, fig.suptitle(_title(maps, what), fontsize=9))
    return fig


def _row(maps: AttentionMaps, row: int) -> int:
    Tq = maps.weights.shape[2]
    if isinstance(row, bool) or not isinstance(row, int) or not -Tq <= row < Tq:
        raise ValueError(f"row must be an index into the {Tq} query rows, got {row!r}")
    return row % Tq


def draw_focus(maps: AttentionMaps, row: int = 0, *, panel: float = 2.6) -> Any:
    """Where query row ``row`` (an index into ``maps.queries``) looks: one panel per kept layer
    (:data:`FOCUS_COLUMNS` a row), in it one line per head — that head's weights over the
    keys."""
    plt = pyplot()
    i = _row(maps, row)
    L, H = maps.weights.shape[:2]
    height = min(max(0.16 * H, 0.5), 3.0)
    cols = min(L, FOCUS_COLUMNS)  # a deep model's layers in rows of panels, not one long strip
    rows = -(-L // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(cols * panel + 0.9, rows * (height + 1.0) + 0.4), dpi=100,
        squeeze=False,
    )  # fmt: skip
    for ax in axes.flat[L:]:
        ax.set_visible(False)
    for li in range(L):
        ax = axes[li // cols, li % cols]
        _panel(ax, maps.weights[li, :, i, :])  # (H, Tk)
        ax.set_title(maps.layers[li], fontsize=8, pad=2)
        label_axis(ax, "x", maps.keys, panel)
        if li % cols == 0:
            label_axis(ax, "y", maps.head_labels, height)
        else:
            _no_ticks(ax, "y")
    token = escape(maps.queries[i])
    position = maps.query_positions[i]
    what = f"where {token!r} (position {position}) looks: one line per head"
    fit_layout(fig, fig.suptitle(_title(maps, what), fontsize=9))
    return fig


def draw_alignment(maps: AttentionMaps, *, panel: float = 2.8) -> Any:
    """Cross-attention as an alignment: per kept layer, the mean over the kept heads of the
    target tokens' (rows) weights on the source tokens (columns), each cell's weight written in
    it when the matrix is small."""
    if maps.kind != "cross":
        raise ValueError(f"an alignment draws cross-attention maps, got kind {maps.kind!r}")
    plt = pyplot()
    L, _, Tq, Tk = maps.weights.shape
    height = panel * min(max(Tq / Tk, 0.5), 2.0)
    fig, axes = plt.subplots(1, L, figsize=(L * panel + 1.0, height + 1.2), dpi=100, squeeze=False)
    for li in range(L):
        ax = axes[0, li]
        w = maps.weights[li].mean(axis=0)  # (Tq, Tk)
        _panel(ax, w)
        ax.set_title(maps.layers[li], fontsize=8, pad=2)
        label_axis(ax, "x", maps.keys, panel)
        if li == 0:
            label_axis(ax, "y", maps.queries, height)
            ax.set_ylabel("target", fontsize=7)
        else:
            _no_ticks(ax, "y")
        ax.set_xlabel("source", fontsize=7)
        if Tq * Tk <= 16 * 16:
            top = max(float(w.max()), 1e-12)
            for (q, k), v in np.ndenumerate(w):
                ax.text(k, q, f"{v:.2f}"[1:] if v < 1 else "1", ha="center", va="center",
                        fontsize=5, color="black" if v > 0.6 * top else "white")  # fmt: skip
    heads = "mean of heads " + ",".join(str(h) for h in maps.heads)
    what = f"cross-attention, target × source ({heads})"
    fit_layout(fig, fig.suptitle(_title(maps, what), fontsize=9))
    return fig


def _title(maps: AttentionMaps, what: str) -> str:
    return f"{escape(maps.title)}\n{what}" if maps.title else what
