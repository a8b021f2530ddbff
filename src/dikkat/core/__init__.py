"""Pure attention functions and masks: tensors in, tensors out, no parameters."""

from dikkat.core import masks
from dikkat.core.attention import (
    AUTO_ORDER,
    AttentionAux,
    AttentionRequest,
    Backend,
    attention,
    auto_order,
    available_backends,
    explain,
    register_backend,
)
from dikkat.core.caches import cache_sizes, clear_caches
from dikkat.core.capture import Capture, CapturedCall, attention_layers, capture
from dikkat.core.reference import reference_attention, repeat_kv
from dikkat.core.weights import attention_weights

__all__ = [
    "AUTO_ORDER",
    "AttentionAux",
    "AttentionRequest",
    "Backend",
    "Capture",
    "CapturedCall",
    "attention",
    "attention_layers",
    "attention_weights",
    "auto_order",
    "available_backends",
    "cache_sizes",
    "capture",
    "clear_caches",
    "explain",
    "masks",
    "reference_attention",
    "register_backend",
    "repeat_kv",
]
