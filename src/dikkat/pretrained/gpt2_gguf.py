"""A GPT-2-architecture GGUF file (``general.architecture = "gpt2"``) → a dikkat
:class:`~dikkat.models.GPT` and its tokenizer.

Such files come from llama.cpp's converter (Hugging Face's GPT-2 and its kin) or from
``dikkat export --gguf`` (:mod:`dikkat.interop.gguf_gpt2`, which holds the tensor layout both
ways). llama.cpp's ``gpt2`` graph (``src/models/gpt2.cpp``) is a GPT as dikkat builds it: learned
positions, pre-norm blocks of LayerNorm with bias, one fused q/k/v projection with bias, the tanh
GELU, a final LayerNorm, and an output embedding that is ``token_embd`` unless ``output.weight``
is stored. Tensors of any type ``gguf`` dequantises (F32, F16, Q8_0, Q4_0, …) become fp32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dikkat.interop.gguf_gpt2 import ARCHITECTURE, gguf_names, gpt_state
from dikkat.models.gpt import GPT, GPTConfig
from dikkat.models.io import load_checked
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.tokenizer import Tokenizer

__all__ = ["config_from_gguf", "gpt_from_gguf"]


def gpt_from_gguf(file: GGUFFile) -> tuple[GPT, Tokenizer]:
    """The GPT and the tokenizer of an open ``gpt2`` GGUF file (fp32, built once: each tensor
    read and dequantised once, and kept as the parameter)."""
    source = str(file.path)
    config = config_from_gguf(file.metadata, file.tensors, source)
    wanted, stored = gguf_names(config), set(file.tensors)
    missing, extra = sorted(wanted - stored), sorted(stored - wanted)
    if missing or extra:
        raise ValueError(
            f"{source} does not hold the tensors of a GGUF 'gpt2' model: missing {missing[:4]}"
            f"{' …' * (len(missing) > 4)}, not used by dikkat {extra[:4]}{' …' * (len(extra) > 4)}"
        )
    state = gpt_state({name: file.read(name) for name in sorted(wanted)}, config)
    with torch.device("meta"):
        model = GPT(config)
    load_checked(model, state, source, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight  # assign=True replaced the shared parameter
    return model, Tokenizer.from_gguf_metadata(file.metadata)


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> GPTConfig:
    """The :class:`GPTConfig` a ``gpt2`` GGUF header describes (``tensors``: the file's
    :attr:`GGUFFile.tensors`, which tell the vocabulary and tying)."""
    if meta.get("general.architecture") != ARCHITECTURE:
        raise ValueError(f"{source} is not a GGUF 'gpt2' model")

    def get(key: str) -> Any:
        value = meta.get(f"{ARCHITECTURE}.{key}")
        if value is None:
            raise ValueError(f"{source}: the GGUF header has no {ARCHITECTURE}.{key}")
        return value

    d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = meta.get(f"{ARCHITECTURE}.attention.head_count_kv", n_heads)
    if isinstance(kv_heads, list):
        raise ValueError(f"{source}: per-layer key/value head counts are not supported")
    for key in ("attention.key_length", "attention.value_length"):
        dim = meta.get(f"{ARCHITECTURE}.{key}")
        if dim is not None and int(dim) != d_model // n_heads:
            raise ValueError(
                f"{source}: {ARCHITECTURE}.{key} = {dim}, not width / heads = {d_model // n_heads}:"
                " a GPT's heads split its width"
            )
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{source} holds no token_embd.weight")
    n_tokens = len(meta.get("tokenizer.ggml.tokens") or ())
    if n_tokens != embedding.shape[0]:
        raise ValueError(
            f"{source}: {n_tokens} tokens in the vocabulary, {embedding.shape[0]} rows in "
            "token_embd.weight: they must be equal"
        )
    d_ff = int(get("feed_forward_length"))
    fields: dict[str, Any] = dict(
        vocab_size=n_tokens,
        max_len=int(get("context_length")),
        d_model=d_model,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=None if int(kv_heads) == n_heads else int(kv_heads),
        d_ff=None if d_ff == 4 * d_model else d_ff,  # GPTConfig's default, as GPT-2's
        position="learned",
        bias=True,
        norm_eps=_f32_decimal(get("attention.layer_norm_epsilon")),
        activation="gelu_tanh",
        tie_embeddings="output.weight" not in tensors,
    )
    try:
        return GPTConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _f32_decimal(value: float) -> float:
    """The shortest decimal that an fp32 header value rounds from: GGUF stores ε in fp32, so
    1e-5 reads back as 9.99999975e-06; this gives 1e-05 again (the same fp32 number)."""
    return float(str(np.float32(value)))
