"""GPT-2 (llama.cpp's ``gpt2`` architecture), read as a dikkat :class:`~dikkat.models.GPT`.

Such files come from llama.cpp's converter (Hugging Face's GPT-2 and its kin) or from
``dikkat export --gguf`` (:mod:`dikkat.interop.gguf_gpt2`, whose name table this family reads
with). llama.cpp's ``gpt2`` graph (``src/models/gpt2.cpp``) is a GPT as dikkat builds it: learned
positions, pre-norm blocks of LayerNorm with bias, one fused q/k/v projection with bias, the tanh
GELU, a final LayerNorm, and an output embedding that is ``token_embd`` unless ``output.weight``
is stored. HF GPT-2 checkpoints are read by :func:`dikkat.interop.gpt_from_hf`, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dikkat.interop.gguf_gpt2 import ARCHITECTURE, GPT2_BLOCK_TENSORS, GPT2_TENSORS, NO_BIAS
from dikkat.models.gpt import GPT, GPTConfig
from dikkat.pretrained.families.base import (
    GPT2_SPLIT,
    Config,
    Family,
    PreSplit,
    Tensors,
    Weight,
    always,
    never,
)
from dikkat.pretrained.gguf_checks import (
    block_count,
    check_shape,
    header_float,
    header_int,
    vocab_rows,
)

__all__ = ["FAMILY"]


def config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str
) -> GPTConfig:
    """The :class:`GPTConfig` a ``gpt2`` GGUF header describes (``shapes``: the file's tensors,
    name → torch shape, which tell tying, and which the sizes must agree with:
    :mod:`dikkat.pretrained.gguf_checks`)."""
    key = f"{ARCHITECTURE}.{{}}".format
    if isinstance(meta.get(key("attention.head_count_kv")), list):
        raise ValueError(f"{source}: per-layer key/value head counts are not supported")
    n_layers = block_count(meta, key("block_count"), shapes, source)
    d_model = header_int(meta, key("embedding_length"), source)
    n_heads = header_int(meta, key("attention.head_count"), source)
    kv_heads = header_int(meta, key("attention.head_count_kv"), source, default=n_heads)
    for name in ("attention.key_length", "attention.value_length"):
        dim = meta.get(key(name))
        if dim is not None and header_int(meta, key(name), source) != d_model // n_heads:
            raise ValueError(
                f"{source}: {key(name)} = {dim}, not width / heads = {d_model // n_heads}: a "
                "GPT's heads split its width"
            )
    n_tokens = vocab_rows(meta, ARCHITECTURE, shapes, source)
    check_shape(
        shapes, "token_embd.weight", (n_tokens, d_model), f"{key('embedding_length')} = "
        f"{d_model} and the vocabulary of {n_tokens} tokens", source,
    )  # fmt: skip
    d_ff = header_int(meta, key("feed_forward_length"), source)
    fields: dict[str, Any] = dict(
        vocab_size=n_tokens,
        max_len=header_int(meta, key("context_length"), source),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=None if kv_heads == n_heads else kv_heads,
        d_ff=None if d_ff == 4 * d_model else d_ff,  # GPTConfig's default, as GPT-2's
        position="learned",
        bias=True,
        norm_eps=_f32_decimal(header_float(meta, key("attention.layer_norm_epsilon"), source)),
        activation="gelu_tanh",
        tie_embeddings="output.weight" not in shapes,
    )
    try:
        return GPTConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def _f32_decimal(value: float) -> float:
    """The shortest decimal that an fp32 header value rounds from: GGUF stores ε in fp32, so
    1e-5 reads back as 9.99999975e-06; this gives 1e-05 again (the same fp32 number)."""
    return float(str(np.float32(value)))


def _untied(c: Config) -> bool:
    return not c.tie_embeddings


def _row(theirs: str, ours: str) -> Weight:
    """A row of the table; every bias is stored (zeros for a GPT without them)."""
    when = _untied if theirs == "output" else always
    return Weight(ours, theirs, when=when, bias=never if theirs in NO_BIAS else always)


FAMILY = Family(
    name="gpt2",
    model=GPT,
    tensors=Tensors(
        model=tuple(_row(t, o) for t, o in GPT2_TENSORS.items()),
        layer=tuple(_row(t, o) for t, o in GPT2_BLOCK_TENSORS.items()),
    ),
    gguf_architecture=ARCHITECTURE,
    config_from_gguf=config_from_gguf,
    # GPT-2's byte-level BPE, and the names of the tokenizers that reuse it unchanged (llama.cpp's)
    pre_splits=dict.fromkeys(
        ("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo"), PreSplit(GPT2_SPLIT)
    ),
)
