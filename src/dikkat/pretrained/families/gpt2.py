"""GPT-2 (llama.cpp's ``gpt2`` architecture), read as a dikkat :class:`~dikkat.models.GPT`;
and what the other GPT-shaped family (``starcoder2.py``) reads its files with too.

Such files come from llama.cpp's converter (Hugging Face's GPT-2 and its kin) or from
``dikkat export --gguf`` (:mod:`dikkat.interop.gguf_gpt`, whose name tables this family reads
with). llama.cpp's ``gpt2`` graph (``src/models/gpt2.cpp``) is a GPT as dikkat builds it: learned
positions, pre-norm blocks of LayerNorm with bias, one fused q/k/v projection with bias, the tanh
GELU, a final LayerNorm, and an output embedding that is ``token_embd`` unless ``output.weight``
is stored. HF GPT-2 checkpoints are read by :func:`dikkat.interop.gpt_from_hf`, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dikkat.interop.gguf_gpt import BLOCK_TENSORS, NO_BIAS, TENSORS
from dikkat.models.gpt import GPT, GPTConfig
from dikkat.pretrained.families.base import (
    GPT2_SPLIT,
    Config,
    Family,
    PreSplit,
    Tensors,
    Values,
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
from dikkat.pretrained.gguf_file import shown

__all__ = ["FAMILY", "gpt_config_from_gguf", "gpt_tensors"]

ARCHITECTURE = "gpt2"


def gpt_config_from_gguf(
    meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], values: Values, source: str
) -> GPTConfig:
    """The :class:`GPTConfig` a ``gpt2`` or ``starcoder2`` GGUF header describes (``shapes``:
    the file's tensors, name → torch shape, which tell tying, and which the sizes must agree
    with: :mod:`dikkat.pretrained.gguf_checks`)."""
    arch = str(meta.get("general.architecture"))
    rope = arch != ARCHITECTURE
    key = f"{arch}.{{}}".format
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
    rope_fields = _rope_fields(meta, key, shapes, d_model // n_heads, source) if rope else {}
    n_tokens = vocab_rows(meta, arch, shapes, source)
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
        position="rope" if rope else "learned",
        **rope_fields,
        bias=True,
        norm_eps=_f32_decimal(header_float(meta, key("attention.layer_norm_epsilon"), source)),
        activation="gelu_tanh",
        tie_embeddings="output.weight" not in shapes,
    )
    try:
        return GPTConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def _rope_fields(
    meta: Mapping[str, Any],
    key: Any,
    shapes: Mapping[str, tuple[int, ...]],
    head_dim: int,
    source: str,
) -> dict[str, Any]:
    """A RoPE GPT's ``rope_base``; what a GPT's RoPE is not (scaled, or over part of each head)
    is refused by name."""
    scaling = meta.get(key("rope.scaling.type"))
    if scaling not in (None, "none") or "rope_freqs.weight" in shapes:
        raise ValueError(
            f"{source}: RoPE scaling ({shown(scaling or 'rope_freqs')}) is not implemented in "
            "dikkat; this model's long-context positions would be wrong"
        )
    rotated = header_int(meta, key("rope.dimension_count"), source, default=head_dim)
    if rotated != head_dim:
        raise ValueError(
            f"{source}: {key('rope.dimension_count')} = {rotated}: RoPE over part of each head "
            f"(of {head_dim}) is not implemented for this architecture in dikkat"
        )
    base = header_float(meta, key("rope.freq_base"), source, default=10000.0)
    return {"rope_base": _f32_decimal(base)}


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


def gpt_tensors(arch: str) -> Tensors:
    """The tensor table of a GPT-shaped architecture's files (the writer's tables)."""
    return Tensors(
        model=tuple(_row(t, o) for t, o in TENSORS[arch].items()),
        layer=tuple(_row(t, o) for t, o in BLOCK_TENSORS[arch].items()),
    )


FAMILY = Family(
    name="gpt2",
    model=GPT,
    tensors=gpt_tensors(ARCHITECTURE),
    gguf_architecture=ARCHITECTURE,
    config_from_gguf=gpt_config_from_gguf,
    # GPT-2's byte-level BPE, and the names of the tokenizers that reuse it unchanged (llama.cpp's)
    pre_splits=dict.fromkeys(
        ("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo"), PreSplit(GPT2_SPLIT)
    ),
)
