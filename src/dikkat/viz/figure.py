"""Laying out a matplotlib figure so that nothing is clipped, and writing it to disk."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

MARGIN = 6  # pixels kept free between a title and the edge of the canvas


def wrap_to(text: Any, width: float, renderer: Any) -> None:
    """Break the lines of the matplotlib ``Text`` ``text`` at spaces until it is at most
    ``width`` pixels wide (a word longer than a line is cut). A few rounds, as glyphs differ
    in width."""
    for _ in range(4):
        drawn = text.get_window_extent(renderer).width
        if drawn <= width:
            return
        lines = text.get_text().split("\n")
        longest = max(len(line) for line in lines)
        chars = max(8, int(longest * width / drawn) - 1)
        if chars >= longest:
            chars = longest - 1
        text.set_text("\n".join(textwrap.fill(line, chars) or line for line in lines))


def fit_layout(fig: Any, suptitle: Any = None, legend: Any = None) -> None:
    """Lay ``fig`` out so that every title fits: the suptitle within the canvas, each panel's
    title within its panel (broken into lines where needed), then ``tight_layout`` leaves room
    for all of them and for the tick labels. A figure ``legend`` is kept below every panel, in a
    strip of its own at the bottom (make it with ``loc="lower center", bbox_to_anchor=(0.5, 0)``),
    so that it covers no data."""
    renderer = fig.canvas.get_renderer()
    bottom = 0.0
    if legend is not None:
        bottom = (legend.get_window_extent(renderer).height + MARGIN) / fig.bbox.height
    rect = (0.0, bottom, 1.0, 1.0)
    fig.tight_layout(rect=rect)
    for ax in fig.axes:
        if ax.get_title():
            wrap_to(ax.title, ax.get_window_extent(renderer).width, renderer)
    if suptitle is not None:
        wrap_to(suptitle, fig.bbox.width - 2 * MARGIN, renderer)
    fig.tight_layout(rect=rect)


def save_png(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` atomically (temp file + rename, so a crash never
    leaves half a picture over the last good one), then close it. Returns the path."""
    import matplotlib.pyplot as plt  # lazily: slow to import, and only pictures need it

    from dikkat.files import atomic_write

    path = Path(path)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return path
