"""Serving: many generation requests on one decoder at once — an engine with iteration-level
continuous batching over a paged KV cache, with prefix reuse (docs/engine.md) — and an
OpenAI-compatible HTTP server over it, ``create_app``: chat completions, completions,
tokenize (docs/server.md). Nothing here loads a model: the caller (``dikkat serve``) does."""

from typing import Any

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
    "create_app",
    "prefix_hashes",
]


def __getattr__(name: str) -> Any:
    # fastapi is an optional dependency (`pip install dikkat[serve]`): the server module, which
    # imports it, is loaded when create_app is first asked for, never by `import dikkat`
    if name == "create_app":
        from dikkat.serving.server import create_app

        return create_app
    raise AttributeError(f"module 'dikkat.serving' has no attribute {name!r}")
