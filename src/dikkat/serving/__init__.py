"""Serving: an inference engine (continuous batching over a paged KV cache) and an
OpenAI-compatible HTTP server over it (docs/serving.md)."""

from typing import Any

from dikkat.serving.engine import EngineFull, EngineStats, SamplingParams, TokenEvent

__all__ = ["EngineFull", "EngineStats", "SamplingParams", "TokenEvent", "create_app"]


def __getattr__(name: str) -> Any:
    # fastapi is an optional dependency (`pip install dikkat[serve]`): the server module, which
    # imports it, is loaded when create_app is first asked for, never by `import dikkat`
    if name == "create_app":
        from dikkat.serving.server import create_app

        return create_app
    raise AttributeError(f"module 'dikkat.serving' has no attribute {name!r}")
