"""Loss curves of a training run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_losses(
    history: Sequence[dict[str, Any]], path: str | Path, *, title: str = "", unit: str = "loss"
) -> None:
    """Training loss (light, and a moving average) and validation loss against step, as a PNG.

    ``history`` holds records with ``step`` and ``loss`` and/or ``val_loss`` (the trainer's log).
    """
    import matplotlib  # lazily: slow to import, and only pictures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dikkat.viz.figure import save_png

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
    if train or val:
        ax.legend()
    fig.tight_layout()
    save_png(fig, path)
