"""Weight formats for inference: how a weight is held (fp32 packed for oneDNN, bf16, int8, w8a8,
and blocks of 4-, 6- or 8-bit integers as GGUF files and dikkat's own q8/q4 hold them), the
layers that multiply them, and a GGUF file's blocks read and repacked.

One registry, :data:`~dikkat.weights.formats.FORMATS`, maps a format's name to its layer, the
native kernel its product calls (:mod:`dikkat.kernels`) and, for a GGUF block kind, its reader.

========================  ===================================================================
module                    holds
========================  ===================================================================
``formats``               the registry; :data:`WeightFormat`, ``check_weights``, ``repack``
``inference``             :func:`inference_model`: a model's copy with its weights in a format
``held``                  :class:`InferenceLinear`, the base of every layer of such a copy
``dense``                 the layers of fp32, bf16, int8 and w8a8
``int8``                  int8 and w8a8 weights and their products
``packed``                :class:`PackedWeight`, blocks of 4-, 6- or 8-bit integers, and their
                          product :func:`packed_linear`
``packed_layers``         :class:`PackedLinear`, :class:`PackedEmbedding`
``half``                  :class:`HalfLinear`, :class:`HalfEmbedding`: a file's fp16 and bf16
                          matrices kept in 16 bits, multiplied in fp32
``bits``, ``groups``      a packed weight's bit planes, and its rows in the kernel's groups
``block_quantize``        dikkat's own Q8_0 and Q4_0 of any weight ("q8", "q4")
``gguf_blocks``           GGML's block kinds read and repacked into a :class:`PackedWeight`
========================  ===================================================================
"""

from dikkat.weights.block_quantize import quantize_q4, quantize_q8
from dikkat.weights.dense import onednn_linear_available
from dikkat.weights.formats import FORMATS, WEIGHT_FORMATS, Format, WeightFormat
from dikkat.weights.frozen import frozen_linear
from dikkat.weights.half import HalfEmbedding, HalfLinear
from dikkat.weights.held import InferenceLinear
from dikkat.weights.inference import inference_model
from dikkat.weights.int8 import (
    Int8Weight,
    W8A8Weight,
    dequantize_int8,
    int8_linear,
    quantize_int8,
    quantize_w8a8,
    w8a8_available,
    w8a8_linear,
)
from dikkat.weights.packed import PackedWeight, packed_linear
from dikkat.weights.packed_layers import PackedEmbedding, PackedLinear

__all__ = [
    "FORMATS",
    "WEIGHT_FORMATS",
    "Format",
    "HalfEmbedding",
    "HalfLinear",
    "InferenceLinear",
    "Int8Weight",
    "PackedEmbedding",
    "PackedLinear",
    "PackedWeight",
    "W8A8Weight",
    "WeightFormat",
    "dequantize_int8",
    "frozen_linear",
    "inference_model",
    "int8_linear",
    "onednn_linear_available",
    "packed_linear",
    "quantize_int8",
    "quantize_q4",
    "quantize_q8",
    "quantize_w8a8",
    "w8a8_available",
    "w8a8_linear",
]
