"""A fine-tune's adapters as llama.cpp takes them: merged into a copy of the base GGUF file, or
as llama.cpp's own LoRA adapter file (``llama-cli --lora``) — :mod:`dikkat.interop.gguf_lora`
writes both; here the adapters are read from a run and put in the file's row order."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dikkat.interop.gguf_lora import write_lora_gguf, write_merged_gguf
from dikkat.pretrained import Pretrained
from dikkat.pretrained.families import Family
from dikkat.training.finetune import family_of, load_finetuned
from dikkat.training.lora import Site, adapter_sites

__all__ = ["export_lora_gguf", "export_merged_gguf", "file_rows"]


def file_rows(family: Family, ours: str, rows: int, config: object) -> Tensor:
    """Where each of dikkat's rows of the weight ``ours`` (``blocks.0.attn.q_proj.weight``)
    lies in the GGUF file: the family's fix-up (llama.cpp's q/k row order put back in RoPE's
    halves) run on the row numbers, so its inverse is whatever the fix-up does. A fix-up that
    is not a reordering of rows is refused."""
    index = torch.arange(rows, dtype=torch.float64)[:, None]
    moved = family.gguf_fix(ours, index, config)[:, 0]
    order = moved.round().long()
    if moved.shape != (rows,) or not torch.equal(order.sort().values, torch.arange(rows)):
        raise ValueError(f"{family.name}'s reading of {ours} is not a reordering of its rows")
    return order  # dikkat's row j is the file's row order[j]


def export_merged_gguf(run: str | Path, out: str | Path, *, kind: str | None = None) -> Path:
    """The base GGUF file of the fine-tune in ``run`` with its adapters added to the weights,
    each quantised again in its own type (``kind``: every matrix in F16, BF16, F32 or Q8_0);
    a base read from a Hugging Face folder has no such file and is refused."""
    lm, sites = _tuned(run)
    deltas = {}
    for s in sites:
        delta = s.layer.delta(s.name)
        in_file = torch.empty_like(delta)
        in_file[_rows(lm, s, delta.shape[0])] = delta
        deltas[str(s.gguf)] = in_file
    return write_merged_gguf(lm.path, out, deltas, kind=kind)


def export_lora_gguf(run: str | Path, out: str | Path) -> Path:
    """The fine-tune's adapters as llama.cpp's LoRA adapter file for its base GGUF file."""
    lm, sites = _tuned(run)
    adapters = {}
    for s in sites:
        A, B = s.layer.lora_A[s.name].detach(), s.layer.lora_B[s.name].detach()
        in_file = torch.empty_like(B)
        in_file[_rows(lm, s, B.shape[0])] = B
        adapters[str(s.gguf)] = (A, in_file)
    first = sites[0].layer
    return write_lora_gguf(lm.path, out, adapters, alpha=first.scale * first.rank)


def _tuned(run: str | Path) -> tuple[Pretrained, list[Site]]:
    lm = load_finetuned(run)
    if not Path(lm.path).is_file():
        raise ValueError(
            f"{run} was trained on {lm.path}, a Hugging Face folder: a GGUF file is written from "
            "a GGUF base (convert the folder with llama.cpp's convert_hf_to_gguf.py and fine-tune "
            "that), or load its PEFT adapter with peft"
        )
    sites = list(adapter_sites(lm.model, family_of(lm)))
    missing = [s.ours for s in sites if s.gguf is None]
    if missing:
        raise ValueError(f"{missing[:3]} have no tensor of their own in a GGUF file")
    return lm, sites


def _rows(lm: Pretrained, site: Site, rows: int) -> Tensor:
    return file_rows(family_of(lm), f"{site.ours}.weight", rows, lm.model.config)
