"""dikkat — attention and the Transformer, end to end.

>>> import torch, dikkat
>>> q = k = v = torch.randn(1, 8, 16, 64)                      # (B, H, T, D)
>>> out = dikkat.attention(q, k, v, dikkat.masks.causal())      # True = may attend

``import dikkat`` loads the attention core, the layers, generation and the models. The rest —
training, serving, the audits, attention maps, distributed attention, the Hugging Face bridge,
pretrained models — is loaded the first time one of its names is asked for (PEP 562 module
``__getattr__``), so that importing dikkat costs little more than importing torch
(``benchmarks/import_time.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dikkat import masks
from dikkat.core import (
    AttentionAux,
    Capture,
    attention,
    attention_layers,
    attention_weights,
    available_backends,
    capture,
    clear_caches,
    explain,
    reference_attention,
    register_backend,
)
from dikkat.generation import (
    Grammars,
    KVCache,
    LookupStats,
    SamplingParams,
    TokenLogprob,
    generate,
    inference_model,
    iter_generate,
    iter_lookup_generate,
    lookup_generate,
)
from dikkat.layers import (
    MLP,
    ALiBi,
    Block,
    BlockConfig,
    GatedMLP,
    LayerNorm,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RMSNorm,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)
from dikkat.models import (
    BERT,
    GPT,
    BERTConfig,
    Decoder,
    DecoderConfig,
    GPTConfig,
    Seq2Seq,
    Seq2SeqConfig,
)
from dikkat.version import __version__

if TYPE_CHECKING:
    from dikkat import audit, distributed, hf, maps, pretrained, serving
    from dikkat.tasks import TaskSpec
    from dikkat.training.finetune import FinetuneSpec, finetune, load_finetuned
    from dikkat.training.lora import LoraConfig
    from dikkat.training.trainer import TrainConfig, Trainer, train

# Loaded on first use: a part of dikkat by its name (``dikkat.vision.ViT`` after a bare
# ``import dikkat``), a name by the module that defines it.
_LAZY_MODULES = (
    "audit",
    "bench",
    "distributed",
    "functional",
    "hf",
    "interop",
    "maps",
    "pretrained",
    "seeds",
    "serving",
    "tasks",
    "text",
    "training",
    "vision",
    "viz",
)
_LAZY_NAMES = {
    "FinetuneSpec": "dikkat.training.finetune",
    "LoraConfig": "dikkat.training.lora",
    "TaskSpec": "dikkat.tasks",
    "TrainConfig": "dikkat.training.trainer",
    "Trainer": "dikkat.training.trainer",
    "train": "dikkat.training.trainer",
    "finetune": "dikkat.training.finetune",
    "load_finetuned": "dikkat.training.finetune",
}

__all__ = [
    "BERT",
    "GPT",
    "MLP",
    "ALiBi",
    "AttentionAux",
    "BERTConfig",
    "Block",
    "BlockConfig",
    "Capture",
    "Decoder",
    "DecoderConfig",
    "FinetuneSpec",
    "GPTConfig",
    "GatedMLP",
    "Grammars",
    "KVCache",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "LookupStats",
    "LoraConfig",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SamplingParams",
    "Seq2Seq",
    "Seq2SeqConfig",
    "SinusoidalPositionalEncoding",
    "TaskSpec",
    "TokenLogprob",
    "TrainConfig",
    "Trainer",
    "__version__",
    "attention",
    "attention_layers",
    "attention_weights",
    "audit",
    "available_backends",
    "capture",
    "clear_caches",
    "distributed",
    "explain",
    "finetune",
    "generate",
    "hf",
    "inference_model",
    "iter_generate",
    "iter_lookup_generate",
    "load_finetuned",
    "lookup_generate",
    "maps",
    "masks",
    "pretrained",
    "reference_attention",
    "register_backend",
    "serving",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        value: Any = importlib.import_module(f"dikkat.{name}")
    elif name in _LAZY_NAMES:
        module = importlib.import_module(_LAZY_NAMES[name])
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module 'dikkat' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'dikkat' has no attribute {name!r}")
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY_MODULES))
