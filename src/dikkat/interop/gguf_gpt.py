"""A dikkat :class:`~dikkat.models.GPT` as a GGUF file that llama.cpp runs, in one of two
architectures chosen by how the GPT places tokens:

- learned positions: ``gpt2``, laid out as llama.cpp's converter writes GPT-2
  (``convert_hf_to_gguf.py``, class ``GPT2Model``) and as llama.cpp's ``gpt2`` model reads it
  (``src/models/gpt2.cpp``);
- RoPE: ``starcoder2`` (``src/models/starcoder2.cpp``), whose graph is a RoPE GPT's: pre-norm
  blocks of LayerNorm with bias, q/k/v and output projections with biases, RoPE over whole heads
  rotating halves (GGML's "NeoX" rope, as dikkat's :func:`~dikkat.layers.positional.rotate_half`),
  a tanh-GELU MLP of up and down with biases, a final LayerNorm, and ``token_embd`` as the output
  layer when ``output.weight`` is not stored.

The name tables (:data:`TENSORS`, :data:`BLOCK_TENSORS`) are the ones :mod:`dikkat.pretrained`
reads such files with (``dikkat/pretrained/families/gpt2.py`` and ``starcoder2.py``).

Header, under the architecture's name: ``context_length``, ``embedding_length``,
``feed_forward_length``, ``block_count``, ``attention.head_count``, ``attention.head_count_kv``,
``attention.layer_norm_epsilon``;
for ``starcoder2`` also ``rope.freq_base`` and ``rope.dimension_count`` (the head dimension);
and a ``gpt2`` tokenizer (:mod:`dikkat.interop.gguf_vocab`).

Tensors (gguf-py's tables for ``MODEL_ARCH.GPT2`` and ``MODEL_ARCH.STARCODER2``), each ``.weight``
and ``.bias``: ``token_embd`` (and, for ``gpt2``, ``position_embd``) (weights only),
``output_norm``, then per block ``blk.N.attn_norm``, the attention's input projections,
``attn_output``, ``ffn_norm``, ``ffn_up``, ``ffn_down``; ``output.weight`` only when the output
embedding is not tied. ``gpt2`` stores q, k and v as one ``attn_qkv`` (rows stacked, which
llama.cpp splits), ``starcoder2`` as ``attn_q``, ``attn_k``, ``attn_v``, as its converter does. A
weight of ``nn.Linear``'s shape (out, in) is stored as is: GGUF lists dimensions fastest first,
{in, out}, which is what llama.cpp expects.

Both graphs are fixed otherwise: a GPT with another activation than the tanh GELU cannot be
written (``ValueError`` naming it); a GPT without biases is written with zero biases, which compute
the same.
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
    "ARCHITECTURES",
    "BLOCK_TENSORS",
    "NO_BIAS",
    "TENSORS",
    "architecture_of",
    "check_writable",
    "gguf_tensors",
    "write_gguf",
]

GGUFType = Literal["f32", "f16"]

# The GGUF architecture of a GPT, by its position setting
ARCHITECTURES = {"learned": "gpt2", "rope": "starcoder2"}

# Each architecture's tensors: GGUF name → the GPT module that holds it, outside the blocks and
# in block N (``blk.N.``); each is a ``.weight``, with a ``.bias`` beside it unless it is in
# NO_BIAS. ``attn_qkv`` is the fused q/k/v projection's rows [q | k | v], which llama.cpp
# splits; ``output`` is stored only when the output embedding is not tied.
TENSORS = {
    "gpt2": {
        "token_embd": "tok_emb",
        "position_embd": "pos_emb",
        "output_norm": "norm_f",
        "output": "lm_head",
    },
    "starcoder2": {"token_embd": "tok_emb", "output_norm": "norm_f", "output": "lm_head"},
}
_AROUND = {  # the block's tensors but the attention's input projections
    "attn_norm": "norm1",
    "attn_output": "attn.out_proj",
    "ffn_norm": "norm2",
    "ffn_up": "mlp.up",
    "ffn_down": "mlp.down",
}
BLOCK_TENSORS = {
    "gpt2": {**_AROUND, "attn_qkv": "attn.qkv_proj"},
    "starcoder2": {
        **_AROUND,
        "attn_q": "attn.q_proj",
        "attn_k": "attn.k_proj",
        "attn_v": "attn.v_proj",
    },
}
NO_BIAS = frozenset({"token_embd", "position_embd", "output"})


def architecture_of(config: GPTConfig) -> str:
    """The GGUF architecture a GPT of ``config`` is written as (``gpt2`` or ``starcoder2``)."""
    return ARCHITECTURES[config.position]


def check_writable(config: GPTConfig) -> None:
    """Refuse (``ValueError``) a GPT that neither llama.cpp graph computes."""
    if config.activation != "gelu_tanh":
        raise ValueError(
            f"this GPT's MLP uses activation={config.activation!r}: a GGUF "
            f"'{architecture_of(config)}' model uses the tanh GELU (llama.cpp's graph has no "
            "other)"
        )


def gguf_tensors(model: GPT) -> dict[str, Tensor]:
    """``model``'s weights under their GGUF names, in torch order, fp32 (zeros for the biases of
    a GPT without them)."""
    check_writable(model.config)
    arch = architecture_of(model.config)
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
    for theirs, ours in TENSORS[arch].items():
        if theirs != "output" or not model.config.tie_embeddings:
            add(theirs, ours)
    for i in range(model.config.n_layers):
        for theirs, ours in BLOCK_TENSORS[arch].items():
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
    """Write ``model`` and its ``tokenizer`` as a GGUF file at ``path`` (architecture ``gpt2``
    for learned positions, ``starcoder2`` for RoPE), atomically (a failure leaves what was
    there); returns the path.

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

    writer = _writer_class()(tmp, architecture_of(config))
    file_type = gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or "dikkat GPT")
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_len)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.block().d_ff or 4 * config.d_model)
    writer.add_head_count(config.n_heads)
    # always, as llama.cpp's converter writes it: llama.cpp takes the head count where it is
    # missing, but transformers' reader of starcoder2 files takes its config's default (2)
    writer.add_head_count_kv(config.block().kv_heads)
    writer.add_layer_norm_eps(config.norm_eps)
    if config.position == "rope":  # over whole heads
        writer.add_rope_freq_base(config.rope_base)
        writer.add_rope_dimension_count(config.d_model // config.n_heads)
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
