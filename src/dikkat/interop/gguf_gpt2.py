"""A dikkat :class:`~dikkat.models.GPT` as a GPT-2-architecture GGUF file, laid out as
llama.cpp's converter writes GPT-2 (``convert_hf_to_gguf.py``, class ``GPT2Model``) and as
llama.cpp's ``gpt2`` model reads it (``src/models/gpt2.cpp``). The name table
(:data:`GPT2_TENSORS`, :data:`GPT2_BLOCK_TENSORS`) is the one :mod:`dikkat.pretrained` reads
such files with (``dikkat/pretrained/families/gpt2.py``).

Header: ``general.architecture = "gpt2"``, ``gpt2.context_length``, ``.embedding_length``,
``.feed_forward_length``, ``.block_count``, ``.attention.head_count`` (and
``.attention.head_count_kv`` when key/value heads are shared), ``.attention.layer_norm_epsilon``,
and a ``gpt2`` tokenizer (:mod:`dikkat.interop.gguf_vocab`).

Tensors (gguf-py's table for ``MODEL_ARCH.GPT2``), each ``.weight`` and ``.bias``:
``token_embd`` and ``position_embd`` (weights only), ``output_norm``, then per block
``blk.N.attn_norm``, ``blk.N.attn_qkv`` (q, k, v rows stacked: the fused projection llama.cpp
splits), ``attn_output``, ``ffn_norm``, ``ffn_up``, ``ffn_down``; ``output.weight`` only when the
output embedding is not tied, since llama.cpp reuses ``token_embd`` when there is none, as in
the converter's files of Hugging Face's GPT-2. A weight of ``nn.Linear``'s shape (out, in) is
stored as is: GGUF lists dimensions fastest first, {in, out}, which is what llama.cpp expects.

llama.cpp's graph is fixed: LayerNorms and projections with biases, learned positions, the tanh
GELU. A GPT with RoPE, or with another activation, cannot be written (``ValueError`` naming the
difference); a GPT without biases is written with zero biases, which compute the same.
"""

from __future__ import annotations

import os
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
    "GPT2_BLOCK_TENSORS",
    "GPT2_TENSORS",
    "NO_BIAS",
    "check_writable",
    "gguf_tensors",
    "write_gguf",
]

ARCHITECTURE = "gpt2"
GGUFType = Literal["f32", "f16"]

# A gpt2 file's tensors (gguf-py's table for MODEL_ARCH.GPT2): GGUF name → the GPT module that
# holds it, outside the blocks and in block N (``blk.N.``); each is a ``.weight``, with a
# ``.bias`` beside it unless it is in NO_BIAS. ``attn_qkv`` is the fused q/k/v projection's rows
# [q | k | v], which llama.cpp splits; ``output`` is stored only when the output embedding is
# not tied.
GPT2_TENSORS = {
    "token_embd": "tok_emb",
    "position_embd": "pos_emb",
    "output_norm": "norm_f",
    "output": "lm_head",
}
GPT2_BLOCK_TENSORS = {
    "attn_norm": "norm1",
    "attn_output": "attn.out_proj",
    "ffn_norm": "norm2",
    "ffn_up": "mlp.up",
    "ffn_down": "mlp.down",
    "attn_qkv": "attn.qkv_proj",
}
NO_BIAS = frozenset({"token_embd", "position_embd", "output"})


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


def gguf_tensors(model: GPT) -> dict[str, Tensor]:
    """``model``'s weights under their GGUF names, in torch order, fp32 (zeros for the biases of
    a GPT without them)."""
    check_writable(model.config)
    # the state dict, and the fused q/k/v projections it lists as q_proj, k_proj and v_proj
    state = {**model.state_dict(), **dict(model.named_parameters())}
    state = {k: v.detach().to("cpu", torch.float32) for k, v in state.items()}

    def add(theirs: str, ours: str) -> None:
        if theirs.rpartition(".")[2] in NO_BIAS:
            out[f"{theirs}.weight"] = state[f"{ours}.weight"]
            return
        w = state[f"{ours}.weight"]
        out[f"{theirs}.weight"] = w
        out[f"{theirs}.bias"] = state.get(f"{ours}.bias", torch.zeros(w.shape[0]))

    out: dict[str, Tensor] = {}
    for theirs, ours in GPT2_TENSORS.items():
        if theirs != "output" or not model.config.tie_embeddings:
            add(theirs, ours)
    for i in range(model.config.n_layers):
        for theirs, ours in GPT2_BLOCK_TENSORS.items():
            add(f"blk.{i}.{theirs}", f"blocks.{i}.{ours}")
    return {k: v.contiguous() for k, v in out.items()}


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
