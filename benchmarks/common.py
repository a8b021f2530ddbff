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


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {key}")


def peak_memory(fn: Callable[[], object]) -> int:
    """Bytes by which one call of ``fn`` raises this process's peak resident memory.

    Linux only: writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current
    resident size, so the peak after the call minus the resident size before it is what the call
    needed on top of everything already allocated (its inputs, the weights), its result included.
    CPU tensors live in ordinary process memory, so this counts them, temporaries too.
    """
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    out = fn()
    peak = _status_bytes("VmHWM")
    del out
    return max(0, peak - before)


def save_json(name: str, payload: dict) -> Path:
    """Write results atomically to benchmarks/results/NAME.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    tmp.replace(path)
    return path
