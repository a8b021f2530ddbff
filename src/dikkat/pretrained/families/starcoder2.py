"""StarCoder2 (llama.cpp's ``starcoder2`` architecture), read as a dikkat
:class:`~dikkat.models.GPT` with RoPE.

llama.cpp's ``starcoder2`` graph (``src/models/starcoder2.cpp``) is a RoPE GPT as dikkat builds it:
pre-norm blocks of LayerNorm with bias, q/k/v and output projections with biases, RoPE over whole
heads that rotates halves (GGML's "NeoX" rope: the rows need no reordering, unlike ``llama``
files), a tanh-GELU MLP of up and down with biases, a final LayerNorm, and ``token_embd`` as the
output layer unless ``output.weight`` is stored. ``dikkat export --gguf`` writes a RoPE GPT as
such a file (:mod:`dikkat.interop.gguf_gpt`); llama.cpp's converter writes BigCode's StarCoder2
checkpoints so (their sliding window, which llama.cpp's graph does not apply, is not applied here
either). The header and tensors are read as for ``gpt2`` files (``gpt2.py``), with
``rope.freq_base``; RoPE scaling and partial rotation are refused by name. The tokenizers these
files carry are named by the families that own them (StarCoder's ``starcoder`` split is in
``llama.py``).
"""

from __future__ import annotations

from dikkat.models.gpt import GPT
from dikkat.pretrained.families.base import Family
from dikkat.pretrained.families.gpt2 import gpt_config_from_gguf, gpt_tensors

__all__ = ["FAMILY"]

FAMILY = Family(
    name="starcoder2",
    model=GPT,
    tensors=gpt_tensors("starcoder2"),
    gguf_architecture="starcoder2",
    config_from_gguf=gpt_config_from_gguf,
)
