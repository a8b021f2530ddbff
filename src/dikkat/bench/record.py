"""What a benchmark ran on, and its results written as JSON (atomically)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from dikkat.files import atomic_write

__all__ = ["machine", "save_json"]


def machine() -> dict[str, Any]:
    """The CPU, cores, torch threads and versions the figures were measured with."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def save_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``{"machine": …, **payload}`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    text = json.dumps({"machine": machine(), **payload}, indent=2)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path
