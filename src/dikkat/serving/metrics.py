"""``GET /metrics``: the Prometheus text exposition format, written by hand (no dependency).

The format: https://prometheus.io/docs/instrumenting/exposition_formats/ — a ``# HELP`` and a
``# TYPE`` line per metric, then ``name{label="value"} number`` per sample.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

PREFIX = "dikkat"

# the engine's counters (EngineStats field → metric name, type, help)
ENGINE_METRICS = (
    ("running", "requests_running", "gauge", "requests in the running batch"),
    ("waiting", "requests_waiting", "gauge", "requests in the engine's waiting queue"),
    ("free_blocks", "cache_blocks_free", "gauge", "KV cache blocks free (or evictable)"),
    ("total_blocks", "cache_blocks_total", "gauge", "KV cache blocks in all"),
    ("block_size", "cache_block_size", "gauge", "token slots per KV cache block"),
    ("prompt_tokens", "prompt_tokens_total", "counter", "prompt tokens admitted"),
    ("generated_tokens", "generation_tokens_total", "counter", "tokens generated"),
    ("finished", "requests_finished_total", "counter", "requests the engine finished"),
    ("aborted", "requests_aborted_total", "counter", "requests aborted (the client left)"),
    ("failed", "requests_failed_total", "counter", "requests ended alone by their own error"),
    ("prefix_hit_tokens", "prefix_hit_tokens_total", "counter", "prompt tokens reused"),
    ("preempted", "requests_preempted_total", "counter", "requests preempted for KV blocks"),
)


class RequestCounter:
    """HTTP requests answered, by route and status code (safe from any thread)."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()

    def add(self, route: str, status: int) -> None:
        with self._lock:
            self._counts[(route, status)] += 1

    def items(self) -> list[tuple[tuple[str, int], int]]:
        with self._lock:
            return sorted(self._counts.items())


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(stats: Any, requests: RequestCounter) -> str:
    """The metrics page: HTTP requests by route and code, then the engine's ``stats()``."""
    lines = [
        f"# HELP {PREFIX}_http_requests_total HTTP requests answered, by route and status code",
        f"# TYPE {PREFIX}_http_requests_total counter",
    ]
    for (route, status), n in requests.items():
        lines.append(f'{PREFIX}_http_requests_total{{route="{_label(route)}",code="{status}"}} {n}')
    for field, name, kind, help_text in ENGINE_METRICS:
        lines += [
            f"# HELP {PREFIX}_{name} {help_text}",
            f"# TYPE {PREFIX}_{name} {kind}",
            f"{PREFIX}_{name} {int(getattr(stats, field))}",
        ]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """The samples of a metrics page, ``name{labels}`` → value (for tests and benchmarks)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
