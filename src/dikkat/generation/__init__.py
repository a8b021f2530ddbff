"""Inference: the preallocated KV cache, prefill and one-token decode, sampling, and the decoding
loop that every model shares."""

from dikkat.generation.generate import (
    decode_step,
    generate,
    iter_generate,
    left_pad,
    prefill,
    sample,
    sample_loop,
    token_rows,
)
from dikkat.layers.kv_cache import KVCache

__all__ = [
    "KVCache",
    "decode_step",
    "generate",
    "iter_generate",
    "left_pad",
    "prefill",
    "sample",
    "sample_loop",
    "token_rows",
]
