"""dikkat as the attention of Hugging Face models (docs/hf.md).

    import dikkat.hf
    dikkat.hf.register()  # "dikkat" in transformers' AttentionInterface and AttentionMaskInterface
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dikkat")

transformers is an optional dependency: it is imported by :func:`register` and by the
functions transformers calls, never by ``import dikkat``; :func:`register` refuses a
transformers older than :data:`MIN_TRANSFORMERS`. :func:`register_ring` registers
ring attention instead, for a sequence split over processes (docs/distributed.md).
"""

from dikkat.core.capture import Capture, capture
from dikkat.hf.attention import (
    MIN_TRANSFORMERS,
    LayerCall,
    attention_function,
    recording,
    register,
)
from dikkat.hf.keywords import KEYWORDS, Keyword
from dikkat.hf.masks import HFMask, hf_mask
from dikkat.hf.ring import RingMask, register_ring, ring_mask

__all__ = [
    "KEYWORDS",
    "MIN_TRANSFORMERS",
    "Capture",
    "HFMask",
    "Keyword",
    "LayerCall",
    "RingMask",
    "attention_function",
    "capture",
    "hf_mask",
    "recording",
    "register",
    "register_ring",
    "ring_mask",
]
