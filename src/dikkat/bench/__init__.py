"""Benchmarks inside the library: ``dikkat bench attention``, ``dikkat bench cost`` and
``dikkat bench decode`` run these, and ``benchmarks/`` wraps them. Timing and peak memory
helpers live in :mod:`dikkat.bench.timing`, the bytes a decoded token reads and the read
bandwidth in :mod:`dikkat.bench.bandwidth`; nothing here is imported by the rest of dikkat."""

from dikkat.bench.bandwidth import kv_bytes, read_bandwidth, weight_bytes
from dikkat.bench.cost import AttentionCost, attention_cost
from dikkat.bench.decode import DecodeBenchConfig, DecodeBenchResult, run_decode_benchmark
from dikkat.bench.timing import memory_tracking, peak_memory, timeit

__all__ = [
    "AttentionCost",
    "DecodeBenchConfig",
    "DecodeBenchResult",
    "attention_cost",
    "kv_bytes",
    "memory_tracking",
    "peak_memory",
    "read_bandwidth",
    "run_decode_benchmark",
    "timeit",
    "weight_bytes",
]
