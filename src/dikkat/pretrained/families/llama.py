"""Llama (llama.cpp's ``llama`` architecture, transformers' ``LlamaForCausalLM``): RMSNorm before
attention and before a SwiGLU MLP, RoPE, grouped-query attention, and an output layer that may
be the token embedding. Mistral's GGUF files, SmolLM2's and Llama 3's are of this architecture.

llama.cpp's converter permutes the rows of the q and k projections so that RoPE rotates adjacent
pairs (GGML's "normal" rope); dikkat rotates halves (as the HF checkpoint does), so those rows
are permuted back (:func:`unpermute_rope_rows`).
"""

from __future__ import annotations

from torch import Tensor

from dikkat.models.decoder import Decoder, DecoderConfig
from dikkat.pretrained.families.base import DIGITS_GPT2_SPLIT, Family, PreSplit, Tensors
from dikkat.pretrained.families.common import (
    ATTENTION,
    LLAMA_NORMS,
    MLP,
    MODEL,
    all_full,
    llama_gguf_config,
    llama_hf_config,
)

__all__ = ["FAMILY", "LLAMA3_SPLIT", "from_gguf", "unpermute_rope_rows"]

TENSORS = Tensors(model=MODEL, layer=(*ATTENTION, *MLP, *LLAMA_NORMS))


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's reordering of a q or k projection's rows (``n_heads`` heads of D rows):
    within each head it interleaved the two halves, row pairs (j, D/2 + j) → (2j, 2j + 1)."""
    rows = w.shape[0]
    halves = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # (heads, D/2, 2, …)
    return halves.transpose(1, 2).reshape(w.shape)


def from_gguf(name: str, tensor: Tensor, config: DecoderConfig) -> Tensor:
    """The q and k rows (weights and biases) put back in RoPE's halves (see the module doc)."""
    if name.endswith(("attn.q_proj.weight", "attn.q_proj.bias")):
        return unpermute_rope_rows(tensor, config.n_heads)
    if name.endswith(("attn.k_proj.weight", "attn.k_proj.bias")):
        return unpermute_rope_rows(tensor, config.kv_heads)
    return tensor


# Pre-tokenizer expressions of the byte-level vocabularies of Llama-architecture files
# (llama.cpp's names and expressions, src/llama-vocab.cpp)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    # Llama 3's, which takes a word that is a token whole (and its kin: Falcon 3, Pixtral)
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"),
        PreSplit(LLAMA3_SPLIT, whole_words=True),
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreSplit(LLAMA3_SPLIT)),
    # SmolLM2's (and StarCoder's, which it took): every digit split off, then GPT-2's expression
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        PreSplit(DIGITS_GPT2_SPLIT),
    ),
}

FAMILY = Family(
    name="llama",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="llama",
    hf_model_types=("llama",),
    config_from_gguf=llama_gguf_config("llama", TENSORS),
    config_from_hf=llama_hf_config("llama", all_full),
    gguf_fix=from_gguf,
    pre_splits=_PRE_SPLITS,
)
