"""Benchmarks of attention inside the library: ``dikkat bench attention`` and ``dikkat bench
cost`` run these, and ``benchmarks/`` wraps them. Timing and peak memory helpers live in
:mod:`dikkat.bench.timing`; nothing here is imported by the rest of dikkat."""

from dikkat.bench.cost import AttentionCost, attention_cost
from dikkat.bench.timing import memory_tracking, peak_memory, timeit

__all__ = ["AttentionCost", "attention_cost", "memory_tracking", "peak_memory", "timeit"]
