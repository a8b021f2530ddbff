"""What every saved figure must satisfy: nothing clipped, no legend over the data.

:func:`check_layout` draws the figure as :func:`dikkat.viz.figure.save_png` saves it (the whole
canvas, no cropping) and measures, in pixels:

- every text that is drawn — titles, the suptitle, axis labels, the tick labels of ticks in
  view, legend entries, texts in the panels — lies inside the canvas;
- no two titles (the axes' titles and the suptitle) overlap;
- a legend covers no bar, no point of a line and no image of any axes.
"""

from __future__ import annotations

from typing import Any

TOLERANCE = 0.5  # pixels: anti-aliasing of a glyph's edge


def _ticks_out_of_view(fig: Any) -> set[int]:
    """ids of tick labels matplotlib does not draw (their tick lies outside the axis' view)."""
    hidden: set[int] = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                loc = tick.get_loc()
                if loc is None or not low - 1e-9 <= loc <= high + 1e-9:
                    hidden.update((id(tick.label1), id(tick.label2)))
    return hidden


def drawn_texts(fig: Any) -> list[Any]:
    """Every text artist the canvas shows: visible, non-empty, its tick (if any) in view."""
    from matplotlib.text import Text

    hidden = _ticks_out_of_view(fig)
    return [
        t
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and id(t) not in hidden
    ]


def _inside(box: Any, canvas: Any) -> bool:
    return (
        box.x0 >= canvas.x0 - TOLERANCE
        and box.y0 >= canvas.y0 - TOLERANCE
        and box.x1 <= canvas.x1 + TOLERANCE
        and box.y1 <= canvas.y1 + TOLERANCE
    )


def _overlap(a: Any, b: Any) -> bool:
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 1 and min(a.y1, b.y1) - max(a.y0, b.y0) > 1


def layout_problems(fig: Any) -> list[str]:
    """What is wrong with ``fig``'s layout, in words (empty: nothing)."""
    import numpy as np

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    problems = []
    texts = drawn_texts(fig)
    for t in texts:
        box = t.get_window_extent(renderer)
        if not _inside(box, canvas):
            problems.append(
                f"text {t.get_text()!r} at x {box.x0:.0f}…{box.x1:.0f}, y {box.y0:.0f}…"
                f"{box.y1:.0f} leaves the {canvas.width:.0f} × {canvas.height:.0f} px canvas"
            )
    titles = [ax.title for ax in fig.axes if ax.title in texts]
    if fig._suptitle is not None and fig._suptitle in texts:
        titles.append(fig._suptitle)
    for i, a in enumerate(titles):
        for b in titles[i + 1 :]:
            if _overlap(a.get_window_extent(renderer), b.get_window_extent(renderer)):
                problems.append(f"titles {a.get_text()!r} and {b.get_text()!r} overlap")
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
    for legend in filter(None, legends):
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            covered = [
                p for p in ax.patches if p.get_visible() and p is not ax.patch
                if _overlap(p.get_window_extent(renderer), box)
            ]  # fmt: skip
            covered += [im for im in ax.images if _overlap(im.get_window_extent(renderer), box)]
            for line in ax.lines:
                xy = ax.transData.transform(np.asarray(line.get_xydata(), dtype=float))
                inside = (
                    (xy[:, 0] > box.x0) & (xy[:, 0] < box.x1)
                    & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)
                )  # fmt: skip
                if inside.any():
                    covered.append(line)
            if covered:
                problems.append(f"the legend covers {len(covered)} drawn data artists")
    return problems


def check_layout(fig: Any) -> None:
    """Fail, listing what is wrong, unless ``fig`` clips no text and its legend covers no data."""
    problems = layout_problems(fig)
    assert not problems, "\n".join(problems)
