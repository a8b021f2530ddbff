"""Re-measure the tiled backend's speed by rows per block, the ``rows_speed`` of
:mod:`dikkat.core.tuning`, on this machine: ``python -m dikkat.core.measure``.

Notation: ``B`` batch, ``H`` heads, ``n`` tokens (queries = keys), ``D`` head dim.

``rows_speed[b]`` is what the plan divides a windows plan's score cells by to compare block
sizes, so it is measured the way the plan uses it: for a sliding window of 256 keys and packed
documents of 1024 tokens (B = 1, H = 8, n = 8192, D = 64, fp32), the tiled call is timed at each
block size, and cells / time, relative to 128 rows, is that size's speed (the mean over the two
masks). Block sizes are timed round-robin and the fastest repeat kept: on a shared machine the
minimum is the estimate least disturbed by other processes.
"""

from __future__ import annotations

import time

import torch

from dikkat.core import masks
from dikkat.core.tiled import PlanCache, plan_summary, tiled_attention

__all__ = ["measure_rows_speed"]


def measure_rows_speed(
    rows: tuple[int, ...] = (64, 128, 256), n: int = 8192, H: int = 8, D: int = 64, repeat: int = 7
) -> dict[int, float]:
    """The tiled backend's windows speed at each block size in ``rows``, relative to 128 rows
    (128 must be among them); see the module docstring."""
    if 128 not in rows:
        raise ValueError(f"rows must include 128, the size speeds are relative to, got {rows}")
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    shapes = {
        "window256": masks.sliding_window(256),
        "doclen1024": masks.document(torch.arange(n) // 1024),
    }
    speeds: dict[int, list[float]] = {b: [] for b in rows}
    for mask in shapes.values():
        plans = PlanCache()  # plans and tile masks built before timing, as a model's calls reuse
        cells = {b: plan_summary(q, k, mask, block=b, plans=plans).computed_cells for b in rows}
        best = dict.fromkeys(rows, float("inf"))
        for _ in range(repeat + 1):  # the first round warms up
            for b in rows:
                t0 = time.perf_counter()
                tiled_attention(q, k, v, mask, scale=D**-0.5, block=b, plans=plans)
                best[b] = min(best[b], time.perf_counter() - t0)
        for b in rows:
            speeds[b].append(cells[b] / best[b] / (cells[128] / best[128]))
    return {b: sum(s) / len(s) for b, s in speeds.items()}


if __name__ == "__main__":
    measured = measure_rows_speed()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    print("rows per block: speed relative to 128 rows (tuning's rows_speed)")
    for b, speed in measured.items():
        print(f"  {b:4d}: {speed:.2f}")
