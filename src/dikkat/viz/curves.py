"""Loss curves of a training run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_losses(
    history: Sequence[dict[str, Any]], path: str | Path, *, title: str = "", unit: str = "loss"
) -> None:
    """Write :func:`draw_losses` of ``history`` as a PNG at ``path``."""
    from dikkat.viz.figure import save_png

    save_png(draw_losses(history, title=title, unit=unit), path)


def draw_losses(history: Sequence[dict[str, Any]], *, title: str = "", unit: str = "loss") -> Any:
    """Training loss (light, and a moving average) and validation loss against step; returns
    the matplotlib ``Figure`` unsaved.

    ``history`` holds records with ``step`` and ``loss`` and/or ``val_loss`` (the trainer's log).
    """
    import matplotlib  # lazily: slow to import, and only pictures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dikkat.viz.figure import fit_layout

    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        steps, losses = zip(*train, strict=True)
        ax.plot(steps, losses, color="tab:blue", alpha=0.35, lw=1, label="train")
        k = max(1, len(losses) // 25)
        if k > 1:
            smooth = [
                sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1])
                for i in range(len(losses))
            ]
            ax.plot(steps, smooth, color="tab:blue", lw=2, label=f"train (mean of {k})")
    if val:
        steps, losses = zip(*val, strict=True)
        ax.plot(steps, losses, "o-", color="tab:orange", lw=2, ms=4, label="validation")
        ax.annotate(
            f"{losses[-1]:.3f}", (steps[-1], losses[-1]), textcoords="offset points", xytext=(4, 6)
        )
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    legend = None
    if train or val:  # below the axes, where it hides no part of a curve
        legend = fig.legend(loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False)
    fit_layout(fig, legend=legend)
    return fig
