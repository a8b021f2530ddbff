"""Inference: how to decode (:class:`SamplingParams`, what every entry point takes), what a
model must offer to be generated from and served (:class:`DecoderLM`), the preallocated KV
cache, prefill and one-token decode, sampling, the decoding loop that every model shares,
prompt-lookup decoding (greedy, a whole guessed draft checked per model call), constrained
decoding (a text held to a JSON Schema, a regex, choices or a grammar: :class:`Grammars`), and
the weight
formats it decodes in (``inference_model``, re-exported from :mod:`dikkat.layers`: each call
decodes on an inference copy of the model in its format; make one with
``inference_model(model, "int8")`` and pass it to many calls to prepare the weights
once)."""

from dikkat.generation.constraint import ConstraintError, Grammars
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
from dikkat.generation.sampler import (
    NonFiniteLogitsError,
    Sampler,
    TokenLogprob,
    check_finite,
    token_logprobs,
)
from dikkat.generation.sampling import SamplingParams
from dikkat.layers.kv_cache import KVCache
from dikkat.weights.formats import WEIGHT_FORMATS, WeightFormat
from dikkat.weights.inference import inference_model

__all__ = [
    "WEIGHT_FORMATS",
    "CacheLayout",
    "ConstraintError",
    "DecoderLM",
    "Grammars",
    "KVCache",
    "LookupStats",
    "NgramIndex",
    "NonFiniteLogitsError",
    "Sampler",
    "SamplingParams",
    "TokenLogprob",
    "WeightFormat",
    "check_finite",
    "decode_step",
    "generate",
    "inference_model",
    "iter_generate",
    "iter_lookup_generate",
    "left_pad",
    "lookup_generate",
    "prefill",
    "sample",
    "sample_loop",
    "token_logprobs",
    "token_rows",
]
