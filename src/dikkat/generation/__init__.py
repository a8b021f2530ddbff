"""Inference: how to decode (:class:`SamplingParams`, what every entry point takes), what a
model must offer to be generated from and served (:class:`DecoderLM`), the preallocated KV
cache, prefill and one-token decode, sampling, the decoding loop that every model shares,
prompt-lookup decoding (greedy, a whole guessed draft checked per model call), and the weight
formats it decodes in (``packed_for_inference``, re-exported from :mod:`dikkat.layers`: hold
``with packed_for_inference(model, "int8"):`` open around many calls to prepare the weights
once)."""

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
from dikkat.generation.lookup import (
    LookupStats,
    NgramIndex,
    iter_lookup_generate,
    lookup_generate,
)
from dikkat.generation.protocol import CacheLayout, DecoderLM
from dikkat.generation.sampling import Sampler, SamplingParams, TokenLogprob, token_logprobs
from dikkat.layers.kv_cache import KVCache
from dikkat.layers.linear import packed_for_inference
from dikkat.layers.quantized import WEIGHT_FORMATS, WeightFormat

__all__ = [
    "WEIGHT_FORMATS",
    "CacheLayout",
    "DecoderLM",
    "KVCache",
    "LookupStats",
    "NgramIndex",
    "Sampler",
    "SamplingParams",
    "TokenLogprob",
    "WeightFormat",
    "decode_step",
    "generate",
    "iter_generate",
    "iter_lookup_generate",
    "left_pad",
    "lookup_generate",
    "packed_for_inference",
    "prefill",
    "sample",
    "sample_loop",
    "token_logprobs",
    "token_rows",
]
