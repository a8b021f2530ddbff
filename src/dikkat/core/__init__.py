"""Pure attention functions and masks: tensors in, tensors out, no parameters."""

from dikkat.core import masks
from dikkat.core.attention import (
    AttentionRequest,
    Backend,
    attention,
    available_backends,
    explain,
    register_backend,
)
from dikkat.core.reference import reference_attention, repeat_kv
from dikkat.core.weights import attention_weights

__all__ = [
    "AttentionRequest",
    "Backend",
    "attention",
    "attention_weights",
    "available_backends",
    "explain",
    "masks",
    "reference_attention",
    "register_backend",
    "repeat_kv",
]
