"""Plots of an attention benchmark run: time and peak extra memory against n, log-log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dikkat.viz.figure import save_png

__all__ = ["plot_attention"]

_STYLE = {  # backend → (colour, marker), the same in every panel
    "sdpa": ("black", "o"),
    "reference": ("tab:gray", "x"),
    "tiled": ("tab:blue", "s"),
    "auto": ("tab:green", "^"),
    "linear": ("tab:purple", "v"),
    "flex": ("tab:orange", "D"),
}


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _grid(
    result: dict[str, Any], key: str, scale: float, ylabel: str, title: str, path: Path
) -> Path:
    import matplotlib  # lazily: slow to import, and only pictures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows = result["rows"]
    sizes = sorted({r["n"] for r in rows})
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    mask_names = list(dict.fromkeys(r["mask"] for r in rows))
    fig, axes = plt.subplots(
        len(dtypes),
        len(mask_names),
        figsize=(3.6 * len(mask_names) + 0.6, 3.2 * len(dtypes) + 0.6),
        dpi=100,
        squeeze=False,
        sharex=True,
    )
    for i, dtype in enumerate(dtypes):
        for j, mask in enumerate(mask_names):
            ax = axes[i][j]
            dense = mask not in ("none", "causal")  # sdpa is given the dense mask
            for backend, (colour, marker) in _STYLE.items():
                points = sorted(
                    (r["n"], r[key] * scale)
                    for r in rows
                    if (r["dtype"], r["mask"], r["backend"]) == (dtype, mask, backend)
                    and r[key] is not None
                    and r[key] > 0  # a log axis has no 0 (a peak below the page size)
                )
                if points:
                    ns, values = zip(*points, strict=True)
                    label = "sdpa + dense mask" if dense and backend == "sdpa" else backend
                    ax.plot(ns, values, marker=marker, color=colour, lw=1.5, ms=4, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [_tokens(n) for n in sizes])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.set_title(f"{mask} · {dtype}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            if i == len(dtypes) - 1:
                ax.set_xlabel("n (tokens)")
            if j == 0:
                ax.set_ylabel(ylabel)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(f"{title}, B={result['B']}, H={result['H']}, D={result['D']}")
    fig.tight_layout()
    return save_png(fig, path)


def plot_attention(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``attention_time.png`` (median forward ms) and ``attention_memory.png`` (peak extra MiB)
    against n: one panel per (dtype, mask), one line per backend. Returns the two paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _grid(
            result, "seconds", 1e3, "forward ms", "attention time", out_dir / "attention_time.png"
        ),
        _grid(
            result,
            "peak_extra_bytes",
            2**-20,
            "peak extra MiB",
            "attention peak extra memory",
            out_dir / "attention_memory.png",
        ),
    ]
