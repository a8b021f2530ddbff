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

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dikkat.interop.gguf_gpt2 import _BLOCK, ARCHITECTURE, gguf_names, gguf_shapes, gpt_state
from dikkat.models.gpt import GPT, GPTConfig
from dikkat.models.io import load_checked
from dikkat.pretrained.gguf_checks import (
    block_count,
    check_shape,
    gguf_tokenizer,
    header_float,
    header_int,
    vocab_rows,
)
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.tokenizer import Tokenizer
from dikkat.weights.formats import PACKED_KINDS, repack
from dikkat.weights.packed import PackedWeight
from dikkat.weights.packed_layers import PackedEmbedding, PackedLinear

__all__ = ["config_from_gguf", "gpt_from_gguf"]


def gpt_from_gguf(file: GGUFFile, *, packed: bool = False) -> tuple[GPT, Tokenizer]:
    """The GPT and the tokenizer of an open ``gpt2`` GGUF file (fp32, built once: each tensor
    read and dequantised once, and kept as the parameter). ``packed``: the matrices the file
    quantised (Q8_0, Q4_0, …) are kept in their blocks instead (``PackedLinear``, a
    ``PackedEmbedding`` shared with a tied output), as for a Llama's file."""
    source = str(file.path)
    shapes = {name: info.shape for name, info in file.tensors.items()}
    config = config_from_gguf(file.metadata, shapes, source)
    wanted, stored = gguf_names(config), set(file.tensors)
    missing, extra = sorted(wanted - stored), sorted(stored - wanted)
    if missing or extra:
        raise ValueError(
            f"{source} does not hold the tensors of a GGUF 'gpt2' model: missing {missing[:4]}"
            f"{' …' * (len(missing) > 4)}, not used by dikkat {extra[:4]}{' …' * (len(extra) > 4)}"
        )
    for name, shape in gguf_shapes(config).items():  # before any tensor is read
        check_shape(shapes, name, shape, "the header's sizes", source)
    tokenizer = gguf_tokenizer(file)
    held = {n: _repacked(file, n) for n in sorted(wanted) if packed and _packable(file, n)}
    tensors = {
        n: torch.empty(file.tensors[n].shape, device="meta") if n in held else file.read(n)
        for n in sorted(wanted)
    }  # a held matrix is a meta placeholder until its packed layer takes its place
    state = gpt_state(tensors, config)
    with torch.device("meta"):
        model = GPT(config)
    load_checked(model, state, source, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight  # assign=True replaced the shared parameter
    for name, weight in held.items():
        _hold(model, name, weight)
    return model, tokenizer


_LINEAR = ("token_embd.weight", "output.weight", ".attn_qkv.weight", ".attn_output.weight",
           ".ffn_up.weight", ".ffn_down.weight")  # fmt: skip


def _packable(file: GGUFFile, name: str) -> bool:
    """A matrix of a linear layer (or the token table) the file quantised; the position table,
    added rather than multiplied, is dequantised."""
    return name.endswith(_LINEAR) and file.tensors[name].kind_name in PACKED_KINDS


def _repacked(file: GGUFFile, name: str) -> PackedWeight:
    info = file.tensors[name]
    where = f"{file.path}: tensor {name!r}"
    return repack(file.raw(name), info.kind_name, info.shape, name=where)  # type: ignore[arg-type]


def _hold(model: GPT, name: str, weight: PackedWeight) -> None:
    """The layer GGUF tensor ``name`` belongs to, replaced by its packed form."""
    if name == "token_embd.weight":
        model.tok_emb = PackedEmbedding(weight)  # type: ignore[assignment]
        if model.config.tie_embeddings:
            model.lm_head = PackedLinear(weight, None, False)  # the same table
        return
    if name == "output.weight":
        model.lm_head = PackedLinear(weight, None, False)
        return
    _, i, kind, _ = name.split(".")  # blk.N.KIND.weight
    block = model.blocks[int(i)]
    if kind == "attn_qkv":  # the fused q/k/v rows, and the q/k/v views of them
        layer = PackedLinear(weight, block.attn.qkv_proj.bias, False)
        block.attn.qkv_proj = layer
        for part in ("q_proj", "k_proj", "v_proj"):
            object.__setattr__(getattr(block.attn, part), "source", layer)
        return
    parent_path, _, leaf = _BLOCK[kind].rpartition(".")
    parent = block.get_submodule(parent_path)
    setattr(parent, leaf, PackedLinear(weight, getattr(parent, leaf).bias, False))


def config_from_gguf(
    meta: dict[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str
) -> GPTConfig:
    """The :class:`GPTConfig` a ``gpt2`` GGUF header describes (``shapes``: the file's tensors,
    name → torch shape, which tell tying, and which the sizes must agree with:
    :mod:`dikkat.pretrained.gguf_checks`)."""
    if meta.get("general.architecture") != ARCHITECTURE:
        raise ValueError(f"{source} is not a GGUF 'gpt2' model")
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
