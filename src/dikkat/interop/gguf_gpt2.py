"""A dikkat :class:`~dikkat.models.GPT` as a GPT-2-architecture GGUF file, laid out as
llama.cpp's converter writes GPT-2 (``convert_hf_to_gguf.py``, class ``GPT2Model``) and as
llama.cpp's ``gpt2`` model reads it (``src/models/gpt2.cpp``); and the way back, GGUF tensors →
GPT's state dict, which :mod:`dikkat.pretrained` uses to read such files.

Header: ``general.architecture = "gpt2"``, ``gpt2.context_length``, ``.embedding_length``,
``.feed_forward_length``, ``.block_count``, ``.attention.head_count`` (and
``.attention.head_count_kv`` when key/value heads are shared), ``.attention.layer_norm_epsilon``,
and a ``gpt2`` tokenizer (:mod:`dikkat.interop.gguf_vocab`).

Tensors (gguf-py's table for ``MODEL_ARCH.GPT2``), each ``.weight`` and ``.bias``:
``token_embd`` and ``position_embd`` (weights only), per block ``blk.N.attn_norm``,
``blk.N.attn_qkv`` (q, k, v rows stacked: the fused projection llama.cpp splits), ``attn_output``,
``ffn_norm``, ``ffn_up``, ``ffn_down``, then ``output_norm``; ``output.weight`` only when the
output embedding is not tied, since llama.cpp reuses ``token_embd`` when there is none, as in
the converter's files of Hugging Face's GPT-2. A weight of ``nn.Linear``'s shape (out, in) is
stored as is: GGUF lists dimensions fastest first, {in, out}, which is what llama.cpp expects.

llama.cpp's graph is fixed: LayerNorms and projections with biases, learned positions, the tanh
GELU. A GPT with RoPE, or with another activation, cannot be written (``ValueError`` naming the
difference); a GPT without biases is written with zero biases, which compute the same.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from dikkat.files import atomic_write
from dikkat.interop.gguf_vocab import GGUFVocab, gguf_vocab
from dikkat.models.gpt import GPT, GPTConfig
from dikkat.validate import check_choice

__all__ = [
    "ARCHITECTURE",
    "check_writable",
    "gguf_names",
    "gguf_shapes",
    "gguf_tensors",
    "gpt_state",
    "write_gguf",
]

ARCHITECTURE = "gpt2"
GGUFType = Literal["f32", "f16"]

# GGUF name of a block's tensor → GPT's (attn_qkv is three of GPT's: q_proj, k_proj, v_proj)
_BLOCK = {
    "attn_norm": "norm1",
    "attn_output": "attn.out_proj",
    "ffn_norm": "norm2",
    "ffn_up": "mlp.up",
    "ffn_down": "mlp.down",
}
_QKV = ("attn.q_proj", "attn.k_proj", "attn.v_proj")


def check_writable(config: GPTConfig) -> None:
    """Refuse (``ValueError``) a GPT that llama.cpp's ``gpt2`` graph cannot compute."""
    if config.position != "learned":
        raise ValueError(
            f"this GPT has position={config.position!r}: a GGUF 'gpt2' model adds learned "
            "positions (llama.cpp's gpt2 graph has no RoPE)"
        )
    if config.activation != "gelu_tanh":
        raise ValueError(
            f"this GPT's MLP uses activation={config.activation!r}: a GGUF 'gpt2' model uses "
            "the tanh GELU (llama.cpp's gpt2 graph has no other)"
        )


def gguf_names(config: GPTConfig) -> set[str]:
    """Every tensor name a ``gpt2`` GGUF file of ``config`` holds."""
    names = {"token_embd.weight", "position_embd.weight"}
    names |= {f"output_norm.{p}" for p in ("weight", "bias")}
    if not config.tie_embeddings:
        names.add("output.weight")
    for i in range(config.n_layers):
        names |= {f"blk.{i}.{t}.{p}" for t in (*_BLOCK, "attn_qkv") for p in ("weight", "bias")}
    return names


def gguf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The torch-order shape of each tensor of :func:`gguf_names` (what a file of ``config``
    holds; a reader checks a file's tensors against it before reading them)."""
    C, V, block = config.d_model, config.vocab_size, config.block()
    qkv = C + 2 * block.kv_heads * (C // config.n_heads)  # q rows, then k's and v's
    F = block.d_ff or 4 * C
    rows = {"attn_norm": C, "attn_qkv": qkv, "attn_output": C, "ffn_norm": C, "ffn_up": F,
            "ffn_down": C}  # fmt: skip
    columns = {"attn_qkv": C, "attn_output": C, "ffn_up": C, "ffn_down": F}
    shapes = {"token_embd.weight": (V, C), "position_embd.weight": (config.max_len, C)}
    shapes |= {"output_norm.weight": (C,), "output_norm.bias": (C,)}
    if not config.tie_embeddings:
        shapes["output.weight"] = (V, C)
    for i in range(config.n_layers):
        for kind, n in rows.items():
            weight = (n, columns[kind]) if kind in columns else (n,)
            shapes |= {f"blk.{i}.{kind}.weight": weight, f"blk.{i}.{kind}.bias": (n,)}
    return shapes


def gguf_tensors(model: GPT) -> dict[str, Tensor]:
    """``model``'s weights under their GGUF names, in torch order, fp32 (zeros for the biases of
    a GPT without them)."""
    check_writable(model.config)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}

    def with_bias(ours: str) -> tuple[Tensor, Tensor]:
        w = state[f"{ours}.weight"]
        return w, state.get(f"{ours}.bias", torch.zeros(w.shape[0]))

    out = {"token_embd.weight": state["tok_emb.weight"]}
    out["position_embd.weight"] = state["pos_emb.weight"]
    out["output_norm.weight"], out["output_norm.bias"] = with_bias("norm_f")
    if not model.config.tie_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(model.config.n_layers):
        for theirs, ours in _BLOCK.items():
            out[f"blk.{i}.{theirs}.weight"], out[f"blk.{i}.{theirs}.bias"] = with_bias(
                f"blocks.{i}.{ours}"
            )
        parts = [with_bias(f"blocks.{i}.{ours}") for ours in _QKV]  # rows [q | k | v]
        out[f"blk.{i}.attn_qkv.weight"] = torch.cat([w for w, _ in parts])
        out[f"blk.{i}.attn_qkv.bias"] = torch.cat([b for _, b in parts])
    return {k: v.contiguous() for k, v in out.items()}


def gpt_state(tensors: Mapping[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """GGUF-named tensors (all of :func:`gguf_names`) → GPT's state dict (the inverse of
    :func:`gguf_tensors`); the fused ``attn_qkv`` is cut into q, k and v rows."""
    block = config.block()
    head_dim = config.d_model // config.n_heads
    sizes = [config.n_heads * head_dim, block.kv_heads * head_dim, block.kv_heads * head_dim]
    state = {"tok_emb.weight": tensors["token_embd.weight"]}
    state["pos_emb.weight"] = tensors["position_embd.weight"]
    state |= {f"norm_f.{p}": tensors[f"output_norm.{p}"] for p in ("weight", "bias")}
    if not config.tie_embeddings:
        state["lm_head.weight"] = tensors["output.weight"]
    for i in range(config.n_layers):
        for theirs, ours in _BLOCK.items():
            for p in ("weight", "bias"):
                state[f"blocks.{i}.{ours}.{p}"] = tensors[f"blk.{i}.{theirs}.{p}"]
        for p in ("weight", "bias"):
            fused = tensors[f"blk.{i}.attn_qkv.{p}"]
            if fused.shape[0] != sum(sizes):
                raise ValueError(
                    f"blk.{i}.attn_qkv.{p} has {fused.shape[0]} rows; {config.n_heads} query and "
                    f"{block.kv_heads} key/value heads of {head_dim} need {sum(sizes)}"
                )
            for ours, part in zip(_QKV, fused.split(sizes), strict=True):
                state[f"blocks.{i}.{ours}.{p}"] = part.contiguous()
    return state


def write_gguf(
    model: GPT,
    tokenizer: object,
    path: str | os.PathLike,
    *,
    dtype: GGUFType = "f32",
    name: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` and its ``tokenizer`` as a GPT-2-architecture GGUF file at ``path``,
    atomically (a failure leaves what was there); returns the path.

    ``dtype`` ``"f16"`` stores the matrices (embeddings included) in fp16 and the norms and
    biases in fp32, as llama.cpp's converter does with ``--outtype f16``. ``name`` is
    ``general.name``. An existing file is replaced only with ``overwrite=True``.

    >>> write_gguf(GPT(GPTConfig()), ByteTokenizer(), "runs/tiny.gguf")  # doctest: +SKIP
    PosixPath('runs/tiny.gguf')
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a dikkat GPT, got {type(model).__name__}")
    check_choice("dtype", dtype, ("f32", "f16"))
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give the path of the .gguf file to write")
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
    tensors = gguf_tensors(model)  # refuses what llama.cpp cannot compute, before any writing
    vocab = gguf_vocab(tokenizer, model.config.vocab_size)
    try:
        atomic_write(path, lambda tmp: _write(tmp, model.config, tensors, vocab, dtype, name))
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def _write(
    tmp: str,
    config: GPTConfig,
    tensors: dict[str, Tensor],
    vocab: GGUFVocab,
    dtype: GGUFType,
    name: str | None,
) -> None:
    import gguf  # the format's own library; a fifth of a second to import: only when writing

    writer = _writer_class()(tmp, ARCHITECTURE)
    file_type = gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or "dikkat GPT")
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_len)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.block().d_ff or 4 * config.d_model)
    writer.add_head_count(config.n_heads)
    kv_heads = config.block().kv_heads
    if kv_heads != config.n_heads:  # llama.cpp reads it for every architecture; 1 key per head
        writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_eps(config.norm_eps)
    writer.add_file_type(file_type)
    _add_vocab(writer, vocab)
    for tensor_name, t in tensors.items():
        # the converter's rule: vectors (norms, biases) stay fp32, matrices take the file type
        half = dtype == "f16" and t.dim() > 1
        writer.add_tensor(tensor_name, t.numpy().astype(np.float16 if half else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_vocab(writer: Any, vocab: GGUFVocab) -> None:
    from gguf import GGUFValueType

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # GPT-2's expression
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    # an empty merge list (the bytes tokenizer) is written too: llama.cpp needs the key
    writer.add_key_value(
        "tokenizer.ggml.merges", vocab.merges, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING
    )
    if vocab.bos_id is not None:
        writer.add_bos_token_id(vocab.bos_id)
    if vocab.eos_id is not None:
        writer.add_eos_token_id(vocab.eos_id)
    # dikkat's tokenizers put nothing before a text; said outright, so that no reader's default
    # for a gpt2 vocabulary adds a BOS
    writer.add_add_bos_token(False)


def _writer_class() -> type[Any]:
    from gguf import GGUFValueType, GGUFWriter

    class EmptyArrayWriter(GGUFWriter):
        """gguf-py's writer, which also writes an empty array of a given element type: GGUF
        allows one (a count of 0), but gguf-py takes an array's type from its first element."""

        def _pack_val(
            self,
            val: Any,
            vtype: GGUFValueType,
            add_vtype: bool,
            sub_type: GGUFValueType | None = None,
        ) -> bytes:
            if vtype == GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return EmptyArrayWriter
