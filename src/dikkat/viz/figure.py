"""Writing a matplotlib figure to disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
