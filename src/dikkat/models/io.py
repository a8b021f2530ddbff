"""Saving and loading models: safetensors weights + a JSON config, each written atomically.

A directory ``path/`` holds ``config.json`` (the frozen config dataclass, the model's class name,
the dikkat version) and ``model.safetensors``. Both are written to temporary names and renamed
into place only once both are written, so a crash while saving never destroys the previous
checkpoint nor pairs new weights with an old config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

M = TypeVar("M", bound="SaveLoad")


def atomic_write(path: Path, write: Any) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it onto ``path``."""
    atomic_write_all({path: write})


def atomic_write_all(writes: dict[Path, Any]) -> None:
    """Write every file to a temporary name beside it, and only once all are written, rename
    them into place: a failed write leaves every old file as it was (and no temporary file)."""
    tmps: dict[Path, str] = {}
    try:
        for path, write in writes.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            tmps[path] = tmp
            write(tmp)
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    except BaseException:
        for tmp in tmps.values():
            Path(tmp).unlink(missing_ok=True)
        raise


def _state_for_saving(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied (shared-storage) tensors stored once, under their first name."""
    seen: dict[tuple[int, int], str] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen[key] = name
        out[name] = t.detach().contiguous()
    return out


def load_checked(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Load ``tensors`` into ``model`` after checking that every name and shape fits.

    Parameters tied to another one (``model.is_tied(name)``) may be absent: loading the other
    fills them. Raises ``ValueError`` naming what is missing, unexpected or of the wrong shape.
    """
    own = model.state_dict()
    is_tied = getattr(model, "is_tied", lambda name: False)
    missing = [k for k in own if k not in tensors and not is_tied(k)]
    unexpected = [k for k in tensors if k not in own]
    wrong = [
        f"{k}: given {tuple(t.shape)}, model {tuple(own[k].shape)}"
        for k, t in tensors.items()
        if k in own and t.shape != own[k].shape
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{source} does not fit the model's config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}"
        )
    model.load_state_dict(tensors, strict=False)  # strict except for tied names


class SaveLoad:
    """Mixin for a model with a frozen-dataclass ``config`` and ``__init__(config)``."""

    config: Any
    config_class: type

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into directory ``path`` (atomically)."""
        from dikkat import __version__

        path = Path(path)
        meta = {
            "model": type(self).__name__,
            "dikkat_version": __version__,
            "config": dataclasses.asdict(self.config),
        }
        tensors = _state_for_saving(self)  # type: ignore[arg-type]
        atomic_write_all(
            {
                path / WEIGHTS_FILE: lambda tmp: save_file(tensors, tmp),
                path / CONFIG_FILE: lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)),
            }
        )
        return path

    @classmethod
    def load(cls: type[M], path: str | os.PathLike, *, map_location: str = "cpu") -> M:
        """Rebuild the model saved in directory ``path``; clear errors for missing or bad files."""
        path = Path(path)
        config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
        for p in (config_path, weights_path):
            if not p.is_file():
                raise FileNotFoundError(f"checkpoint {path} has no {p.name}")
        try:
            meta = json.loads(config_path.read_text())
            config = cls.config_class(**meta["config"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{config_path} is not a valid {cls.__name__} config: {e}") from None
        if meta.get("model") != cls.__name__:
            raise ValueError(f"{path} holds a {meta.get('model')!r}, not a {cls.__name__}")
        try:
            tensors = load_file(weights_path, device=map_location)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{weights_path} is truncated or corrupt: {e}") from None
        model = cls(config)  # type: ignore[call-arg]
        load_checked(model, tensors, str(weights_path))  # type: ignore[arg-type]
        return model

    def is_tied(self, name: str) -> bool:
        """True for a parameter stored under another name (a tied output embedding)."""
        return False
