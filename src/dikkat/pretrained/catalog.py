"""What ``dikkat models`` says of each model the stores hold (:mod:`dikkat.pretrained.stores`):
its architecture, quantisation, size and context, read from a GGUF header or a ``config.json``
alone (no weights are read), and whether dikkat runs it — the family's own config mapping is
asked, so a refusal is the message a load would give."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dikkat.pretrained.families import by_gguf_architecture, by_hf_model_type
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.stores import Stored

__all__ = ["Described", "describe"]


@dataclass(frozen=True)
class Described:
    """One model as ``dikkat models`` lists it; ``why`` is empty where dikkat runs it."""

    stored: Stored
    architecture: str
    quantisation: str
    size: int  # bytes
    context: int | None
    why: str

    @property
    def runs(self) -> bool:
        return not self.why


def describe(stored: Stored) -> Described:
    """The model's header or config, and whether its family takes it (the reason where not)."""
    try:
        return _gguf(stored) if stored.kind == "gguf" else _hf(stored)
    except (OSError, ValueError) as e:
        return Described(stored, "?", "?", _size(stored.path), None, f"unreadable: {e}")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _gguf(stored: Stored) -> Described:
    file = GGUFFile(stored.path)
    arch = str(file.metadata.get("general.architecture", "?"))
    weights = Counter[str]()
    for info in file.tensors.values():
        if len(info.shape) == 2:
            weights[info.kind_name] += info.nbytes
    quant = weights.most_common(1)[0][0] if weights else "?"
    context = file.metadata.get(f"{arch}.context_length")
    why = ""
    try:
        family = by_gguf_architecture(arch, str(stored.path))
        shapes = {name: info.shape for name, info in file.tensors.items()}
        family.config_from_gguf(file.metadata, shapes, file.read, str(stored.path))  # type: ignore[misc]
    except ValueError as e:
        why = _reason(e, stored.path)
    return Described(stored, arch, quant, _size(stored.path), _int(context), why)


def _hf(stored: Stored) -> Described:
    config = json.loads((stored.path / "config.json").read_text())
    model_type = str(config.get("model_type", "?"))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "?")
    why = ""
    try:
        family = by_hf_model_type(model_type, str(stored.path))
        family.config_from_hf(config, str(stored.path))  # type: ignore[misc]
    except ValueError as e:
        why = _reason(e, stored.path)
    context = _int(config.get("max_position_embeddings"))
    return Described(stored, model_type, dtype, _size(stored.path), context, why)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _reason(error: ValueError, path: Path) -> str:
    """The refusal without the path it starts with (the listing shows where the model is)."""
    return str(error).removeprefix(f"{path}: ").removeprefix(f"{path}")
