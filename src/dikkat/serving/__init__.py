"""Serving: many generation requests on one GPT at once — an engine with iteration-level
continuous batching over a paged KV cache, with prefix reuse (docs/engine.md)."""

from dikkat.serving.engine import Engine
from dikkat.serving.paged import BlockAllocator, PagedKVPool, PagedLayerCache, prefix_hashes
from dikkat.serving.requests import EngineFull, EngineStats, SamplingParams, TokenEvent

__all__ = [
    "BlockAllocator",
    "Engine",
    "EngineFull",
    "EngineStats",
    "PagedKVPool",
    "PagedLayerCache",
    "SamplingParams",
    "TokenEvent",
    "prefix_hashes",
]
