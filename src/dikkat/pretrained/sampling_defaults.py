"""The sampling settings a model's makers suggest, where its files say them: a GGUF file's
``general.sampling.*`` keys (llama.cpp's names, gguf-py's ``Keys.General.SAMPLING_*``) and a
Hugging Face folder's ``generation_config.json`` (transformers' ``GenerationConfig``), as
:class:`~dikkat.generation.SamplingParams` keywords. :class:`~dikkat.pretrained.Pretrained` uses
them under the keywords its caller gives; ``dikkat chat`` and ``generate --model`` under their
flags.

A value that is not a setting :class:`SamplingParams` takes (a negative temperature, a string)
is left out with a warning naming the file and the key: a hint, never a reason to refuse a model.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

__all__ = ["from_gguf_metadata", "from_hf_folder"]

# GGUF key → SamplingParams field, and the values it takes
_GGUF = {
    "general.sampling.temp": ("temperature", float, 0.0, math.inf),
    "general.sampling.top_k": ("top_k", int, 1, math.inf),
    "general.sampling.top_p": ("top_p", float, 1e-9, 1.0),
    "general.sampling.penalty_repeat": ("repetition_penalty", float, 1e-9, math.inf),
}
# generation_config.json key → the same
_HF = {
    "temperature": ("temperature", float, 0.0, math.inf),
    "top_k": ("top_k", int, 1, math.inf),
    "top_p": ("top_p", float, 1e-9, 1.0),
    "repetition_penalty": ("repetition_penalty", float, 1e-9, math.inf),
}
_DRAWS = ("temperature", "top_k", "top_p")  # what only sampling (not greedy) reads


def _settings(found: dict[str, Any], names: dict[str, tuple], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (field, kind, low, high) in names.items():
        if key not in found:
            continue
        value = found[key]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and (kind is float or float(value).is_integer()) and low <= value <= high
        if not ok:
            warnings.warn(f"{where}: {key} = {value!r} is not a sampling setting; left out",
                          stacklevel=3)  # fmt: skip
            continue
        out[field] = kind(value)
    return out


def from_gguf_metadata(metadata: dict[str, Any], where: str) -> dict[str, Any]:
    """The sampling keywords of a GGUF file's header (``where`` names it in warnings)."""
    return _settings(metadata, _GGUF, where)


def from_hf_folder(folder: Path) -> dict[str, Any]:
    """The sampling keywords of a folder's ``generation_config.json`` (none without it). Where
    it says ``do_sample: false`` (transformers' default), the model decodes greedily: its
    temperature, top-k and top-p are left out."""
    path = folder / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        warnings.warn(f"{path} is not readable JSON ({e}); no sampling settings taken from it",
                      stacklevel=2)  # fmt: skip
        return {}
    if not isinstance(config, dict):
        return {}
    out = _settings(config, _HF, str(path))
    if not config.get("do_sample", False):
        out = {k: v for k, v in out.items() if k not in _DRAWS}
    return out
