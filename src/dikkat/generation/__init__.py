"""Inference: the preallocated KV cache, prefill and one-token decode, sampling."""

from dikkat.generation.kv_cache import KVCache

__all__ = ["KVCache"]
