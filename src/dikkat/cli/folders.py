"""What a folder given to a command holds, and loading the model a command needs from it.

Every command that reads a run or model folder loads it through :func:`load_model`: a folder of
another kind is answered in one line that says what it holds and which command reads it,
before any weights are read::

    runs/gpt holds a 'lm' run (a GPT), not a translator: use dikkat generate runs/gpt
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from dikkat import runs


@dataclass(frozen=True)
class Reader:
    """The command that reads one kind of model, and what to call that kind in a message."""

    noun: str  # "a translator": what a command asks for when it refuses another kind
    command: str  # "translate": the command that reads a folder holding this model


# model class (config.json's "model") → the command that reads it; a model with no command of
# its own (a new task's) is still named in the refusal, without a suggestion
READERS: dict[str, Reader] = {
    "GPT": Reader("a GPT", "generate"),  # dikkat train --task lm
    "BERT": Reader("a masked-LM BERT", "fill-mask"),  # --task mlm
    "Seq2Seq": Reader("a translator", "translate"),  # --task translate
    "ViT": Reader("a digits ViT", "vit-attention"),  # --task digits
    "DETR": Reader("a shapes DETR", "detect"),  # --task shapes
}


@dataclass(frozen=True)
class Held:
    """What a run or model folder holds, read from its (current checkpoint's) JSON files."""

    path: Path
    is_run: bool  # a training run (run.json), not a model saved with save()
    model: str | None  # the model class, "GPT"; None when config.json does not say
    task: str | None  # the run's task, "lm"; None for a saved model (or an unreadable task.json)
    hf_model_type: str | None = None  # a Hugging Face model folder's "model_type", "gpt2"

    def describe(self) -> str:
        """``a 'lm' run (a GPT)``, ``a saved GPT``, ``a Hugging Face 'gpt2' model``."""
        if self.hf_model_type is not None:
            return f"a Hugging Face {self.hf_model_type!r} model"
        if self.model is None:
            return "a config.json that names no dikkat model"
        if not self.is_run:
            return f"a saved {self.model}"
        task = "" if self.task is None else f"{self.task!r} "
        return f"a {task}run (a {self.model})"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # damaged: left for the loader, whose error names the file and the fault


def _task_file(folder: Path) -> Path:
    """A run's ``task.json`` (its TaskSpec), written by :mod:`dikkat.training.checkpoint`."""
    from dikkat.training.checkpoint import TASK_FILE  # not at the top: see dikkat.cli

    return folder / TASK_FILE


def held(path: str | Path) -> Held:
    """What the run or model folder ``path`` holds; a user error (``FileNotFoundError`` or
    ``ValueError``, one line) if it is neither."""
    path = Path(path)
    kind = runs.folder_kind(path)
    if kind == "missing":
        raise FileNotFoundError(f"{path} does not exist (expected a run or model folder)")
    if kind == "file":
        raise ValueError(f"{path} is a file, not a run or model folder")
    if kind == "empty":
        raise ValueError(f"{path} is an empty folder, not a run or model folder")
    if kind == "other":
        raise ValueError(
            f"{path} is not a run or model folder: it holds {runs.describe_kind(kind)}, and no "
            f"{runs.RUN_FILE} or config.json"
        )
    folder = runs.checkpoint_dir(path)
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise _config_error(folder)
    model = config.get("model") if isinstance(config.get("model"), str) else None
    hf_type = config.get("model_type") if model is None else None
    task = None
    if kind == "run":
        meta = _read_json(_task_file(folder))
        spec = meta.get("task") if isinstance(meta, dict) else None
        task = spec.get("task") if isinstance(spec, dict) else None
    task = task if isinstance(task, str) else None
    return Held(path, kind == "run", model, task, hf_type if isinstance(hf_type, str) else None)


def _config_error(folder: Path) -> Exception:
    """The error for a ``config.json`` that is missing or not a JSON object: a run's manifest
    says what happened to it (truncated, replaced, removed), where there is one."""
    path = folder / "config.json"
    runs.verify_checkpoint(folder, (path.name,))  # raises naming the file, if it differs
    if not path.is_file():
        return FileNotFoundError(f"{path} is missing: {folder} holds no complete model")
    return ValueError(f"{path} is damaged: it is not the JSON object of a model's config")


def refusal(what: Held, wanted: str, *, command: str | None = None) -> str:
    """The one line that refuses ``what`` where ``wanted`` (the noun of a Reader, or any other
    phrase) was needed, and names the command that reads ``what``."""
    line = f"{what.path} holds {what.describe()}, not {wanted}"
    if what.hf_model_type == "gpt2":
        return f"{line}: use dikkat generate --hf-gpt2 {what.path}"
    reader = READERS.get(what.model or "")
    if reader is not None and reader.command != command:
        return f"{line}: use dikkat {reader.command} {what.path}"
    return line


M = TypeVar("M")


def load_model(
    cls: type[M], path: str | Path, command: str, *, verify: bool, device: torch.device
) -> M:
    """``cls.load(path)`` on ``device``, for ``dikkat command``, after checking that ``path``
    holds a ``cls``; a folder of another kind is refused in one line (:func:`refusal`)."""
    what = held(path)
    name = cls.__name__
    if what.model != name:
        noun = READERS[name].noun if name in READERS else f"a {name}"
        raise ValueError(refusal(what, noun, command=command))
    return cls.load(path, verify=verify).to(device)  # type: ignore[attr-defined]


def task_seed(path: str | Path) -> int:
    """The data seed a run was trained with (0 for a model folder, which records none)."""
    task_file = _task_file(runs.checkpoint_dir(path))
    if not task_file.is_file():
        return 0
    try:
        return int(json.loads(task_file.read_text())["task"]["seed"])
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{task_file} is not a valid run description: {e}") from None
