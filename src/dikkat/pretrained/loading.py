"""``dikkat.pretrained.load``: a GGUF file or an HF folder → a native
:class:`~dikkat.models.Decoder` (or, from a GPT-2 GGUF file, a :class:`~dikkat.models.GPT`) with
its tokenizer and chat template.

A GGUF file's quantised tensors (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, …) are dequantised to fp32
by the ``gguf`` package, exactly as transformers reads the same file; ``dtype`` then casts the
model (bf16 halves it). The model is built on the ``meta`` device and takes the loaded tensors as
its parameters (``assign=True``), so its weights are allocated once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from dikkat.models.decoder import Decoder, DecoderConfig
from dikkat.models.gpt import GPT
from dikkat.models.io import load_checked
from dikkat.pretrained import families
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.gpt2_gguf import gpt_from_gguf
from dikkat.pretrained.session import Pretrained
from dikkat.pretrained.sources import resolve
from dikkat.pretrained.tokenizer import Tokenizer

__all__ = ["load"]

# tensors some HF checkpoints carry that hold nothing a model needs (RoPE tables it recomputes)
_HF_IGNORED = ("rotary_emb.inv_freq",)


def load(
    source: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Pretrained:
    """Load a pretrained decoder: ``source`` is a name (``"smollm2"``, ``"gemma3-270m"``), a
    ``.gguf`` file, or a Hugging Face folder (``config.json``, safetensors weights,
    ``tokenizer.json``) of a Llama, Mistral, Qwen2 or Gemma 3 (text) model. A GGUF file of the
    ``gpt2`` architecture (llama.cpp's converter, ``dikkat export --gguf``) becomes a
    :class:`~dikkat.models.GPT`, any other a :class:`~dikkat.models.Decoder`.

    Returns a :class:`Pretrained` (``.model``, ``.tokenizer``, ``.generate``, ``.chat``), the
    model in evaluation mode on ``device``, in ``dtype`` (None: fp32).
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    found = resolve(source)
    if found.kind == "gguf":
        model, tokenizer, template = _from_gguf(found.path)
    else:
        model, tokenizer, template = _from_hf(found.path)
    model.to(device=device, dtype=dtype or torch.float32).eval()
    return Pretrained(model, tokenizer, template, found.name, found.path)


def _from_gguf(path: Path) -> tuple[Decoder | GPT, Tokenizer, str | None]:
    file = GGUFFile(path)
    if file.architecture == "gpt2":  # GPT-2's layout, a dikkat GPT (gpt2_gguf.py)
        model, tokenizer = gpt_from_gguf(file)
        return model, tokenizer, file.metadata.get("tokenizer.chat_template")
    config = families.config_from_gguf(file.metadata, set(file.tensors), str(path))
    names = families.gguf_names(config)
    _check_names(set(file.tensors), set(names), (), str(path))

    def read(name: str) -> Tensor:
        return families.from_gguf(name, file.read(name), config)

    model = _assemble(config, names, read, str(path))
    tokenizer = Tokenizer.from_gguf_metadata(file.metadata)
    return model, tokenizer, file.metadata.get("tokenizer.chat_template")


def _from_hf(folder: Path) -> tuple[Decoder, Tokenizer, str | None]:
    from safetensors import safe_open

    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder / 'config.json'} is not readable JSON: {e}") from None
    config = families.config_from_hf(hf, str(folder))
    names = families.hf_names(config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors weights")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where |= {key: file for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    if config.tie_embeddings:
        where.pop("lm_head.weight", None)  # a tied copy some checkpoints store anyway
    _check_names(set(where), set(names), _HF_IGNORED, str(folder))

    def read(name: str) -> Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return families.from_hf(name, f.get_tensor(name).float(), config)

    model = _assemble(config, names, read, str(folder))
    tokenizer, template = Tokenizer.from_hf_folder(folder)
    return model, tokenizer, template


def _check_names(stored: set[str], wanted: set[str], ignored: tuple[str, ...], source: str) -> None:
    """Every tensor the model takes is stored, and every stored tensor is taken (or known to be
    meaningless): weights of a component dikkat lacks are refused, never dropped."""
    missing = sorted(wanted - stored)
    extra = sorted(n for n in stored - wanted if not n.endswith(ignored))
    if missing or extra:
        raise ValueError(
            f"{source} does not hold the tensors its config describes: missing {missing[:4]}"
            f"{' …' * (len(missing) > 4)}, not used by dikkat {extra[:4]}{' …' * (len(extra) > 4)}"
        )


def _assemble(
    config: DecoderConfig, names: dict[str, str], read: Callable[[str], Tensor], source: str
) -> Decoder:
    """A Decoder holding the stored tensors (each read once, its memory kept as the parameter)."""
    with torch.device("meta"):
        model = Decoder(config)
    state = {ours: read(theirs) for theirs, ours in names.items()}
    load_checked(model, state, source, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight  # assign=True replaced the shared parameter
    return model
