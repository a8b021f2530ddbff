"""What the scripts in benchmarks/ share: the library's timing and memory helpers
(:mod:`dikkat.bench`), and where their results go. Never imported by the library."""

from __future__ import annotations

from pathlib import Path

from dikkat.bench.record import machine
from dikkat.bench.record import save_json as _save_json
from dikkat.bench.timing import peak_memory, timeit

__all__ = ["RESULTS", "machine", "peak_memory", "save_json", "timeit"]

RESULTS = Path(__file__).parent / "results"


def save_json(name: str, payload: dict) -> Path:
    """Write results atomically to benchmarks/results/NAME.json, with the machine they ran on."""
    return _save_json(RESULTS / f"{name}.json", payload)
