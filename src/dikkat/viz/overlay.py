"""A ViT's class-token attention laid over its image, and attention beside a token importance.

Each function returns the matplotlib ``Figure`` unsaved (:func:`dikkat.viz.figure.save_png`
writes it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dikkat.viz.figure import fit_layout
from dikkat.viz.heatmaps import escape, label_axis, pyplot
from dikkat.viz.maps import AttentionMaps

__all__ = ["draw_image_attention", "draw_importance"]

MIN_WIDTH = 5.5  # inches: room for a panel's title with two correlations
COLOURS = ("tab:orange", "tab:green", "tab:blue", "tab:red")  # one per importance measure


def draw_image_attention(maps: AttentionMaps, image: np.ndarray, *, panel: float = 1.5) -> Any:
    """One row per kept layer: the image, then the mean of the kept heads and each head — the
    query's weights on the patches, painted over the image (each on its own scale).

    Args:
        maps: kind ``"image"``; its last ``g²`` keys are the patches of a g × g grid in
            row-major order (any keys before them, a class token, are left out of the picture);
            with several query rows their mean is drawn.
        image: (side, side) grey or (side, side, 3) colour, values in [0, 1].
    """
    if maps.kind != "image":
        raise ValueError(f"draw_image_attention draws image maps, got kind {maps.kind!r}")
    image = np.asarray(image, dtype=np.float64)
    if image.ndim not in (2, 3) or image.shape[0] != image.shape[1]:
        raise ValueError(f"image must be (side, side) or (side, side, 3), got {image.shape}")
    L, H, _, Tk = maps.weights.shape
    with_class = math.isqrt(Tk - 1) if Tk > 1 else 0
    grid = with_class if with_class**2 == Tk - 1 else math.isqrt(Tk)
    if grid * grid not in (Tk, Tk - 1) or grid == 0:
        raise ValueError(f"{Tk} keys are not a square grid of patches (with or without a class)")
    patches = maps.weights[..., Tk - grid * grid :].mean(axis=2)  # (L, H, g²)
    plt = pyplot()
    cols = 2 + H
    fig, axes = plt.subplots(L, cols, figsize=(cols * panel, L * panel + 0.6), dpi=100,
                             squeeze=False)  # fmt: skip
    side = image.shape[0]
    grey = image.ndim == 2
    for li in range(L):
        columns = [("image", None), ("mean of heads", patches[li].mean(axis=0))]
        columns += [(label, patches[li, hi]) for hi, label in enumerate(maps.head_labels)]
        for c, (label, w) in enumerate(columns):
            ax = axes[li, c]
            ax.imshow(image, cmap="gray_r" if grey else None, interpolation="nearest")
            if w is not None:
                ax.imshow(w.reshape(grid, grid), cmap="magma", alpha=0.65, vmin=0.0,
                          vmax=max(float(w.max()), 1e-12), interpolation="nearest",
                          extent=(-0.5, side - 0.5, side - 0.5, -0.5))  # fmt: skip
            ax.set_title(f"{maps.layers[li]} · {label}" if w is not None else label, fontsize=6)
            ax.set_xticks([])
            ax.set_yticks([])
    who = ", ".join(escape(q) for q in dict.fromkeys(maps.queries))
    head = f"{escape(maps.title)}\n" if maps.title else ""
    what = f"{head}where {who} looks over the patches (each map on its own scale)"
    fit_layout(fig, fig.suptitle(what, fontsize=9))
    return fig


def draw_importance(
    tokens: Sequence[str],
    importance: Mapping[str, np.ndarray],
    attention: Mapping[str, np.ndarray],
    correlations: Mapping[str, Mapping[str, float]],
    *,
    title: str = "",
) -> Any:
    """One panel per attention row in ``attention``: its weights over ``tokens`` as bars beside
    each importance of ``importance``, every series scaled to its own largest value, and the
    rank correlation ``correlations[attention name][importance name]`` in the panel's title."""
    n = len(tokens)
    for name, values in [*importance.items(), *attention.items()]:
        if np.shape(values) != (n,):
            raise ValueError(
                f"{name!r} has shape {np.shape(values)}, expected ({n},) for the tokens"
            )
    if not attention or not importance:
        raise ValueError("draw_importance needs at least one attention row and one importance")
    plt = pyplot()
    width = max(MIN_WIDTH, 0.28 * n + 1.5)
    fig, axes = plt.subplots(len(attention), 1, figsize=(width, 1.9 * len(attention) + 1.1),
                             dpi=100, squeeze=False)  # fmt: skip
    series = 1 + len(importance)
    bar = 0.8 / series
    x = np.arange(n)
    colours = [COLOURS[k % len(COLOURS)] for k in range(len(importance))]
    for ax, (name, att) in zip(axes[:, 0], attention.items(), strict=True):
        ax.bar(x - 0.4 + bar / 2, _unit(att), bar, label="attention (the panel's)",
               color="tab:purple")  # fmt: skip
        rho = []
        for k, (method, values) in enumerate(importance.items()):
            ax.bar(x - 0.4 + bar * (k + 1.5), _unit(values), bar, label=method, alpha=0.8,
                   color=colours[k])  # fmt: skip
            value = correlations.get(name, {}).get(method, float("nan"))
            rho.append(f"ρ({method}) = {value:+.2f}")
        ax.set_title(f"{escape(name)}: " + ", ".join(rho), fontsize=8)
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_yticks([])
        label_axis(ax, "x", tokens, width - 1.0)
    # one legend for every panel (the same series in each), below them all: it covers no bar
    handles, labels = axes[0, 0].get_legend_handles_labels()
    legend = fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.0),
                        ncol=series, fontsize=7, frameon=False)  # fmt: skip
    head = f"{escape(title)}\n" if title else ""
    what = f"{head}attention against importance (each series scaled to its maximum)"
    fit_layout(fig, fig.suptitle(what, fontsize=9), legend)
    return fig


def _unit(values: np.ndarray) -> np.ndarray:
    v = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
    top = float(np.abs(v).max()) if v.size else 0.0
    return v / top if top > 0 else v
