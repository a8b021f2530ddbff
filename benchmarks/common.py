"""Timing helpers shared by the benchmarks (never imported by the library)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    """What the figures were measured on."""
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


def timeit(fn: Callable[[], object], *, min_time: float = 0.3, warmup: int = 1) -> float:
    """Median seconds per call over repeated calls lasting at least ``min_time`` in total."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while not times or (time.perf_counter() - start < min_time and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def save_json(name: str, payload: dict) -> Path:
    """Write results atomically to benchmarks/results/NAME.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    tmp.replace(path)
    return path
