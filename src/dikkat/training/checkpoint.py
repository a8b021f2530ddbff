"""A training run on disk: what a checkpoint holds, how it is written and read back.

A checkpoint is one folder committed by :func:`dikkat.runs.commit_checkpoint` (all files or
none)::

    config.json, model.safetensors   the model (GPT.load / BERT.load / … of the run folder)
    tokenizer_config.json | tokenizer.json
    task.json                        the TaskSpec and the TrainConfig
    trainer_state.pt                 step, optimizer, scheduler, RNG state and the log's history
    manifest.json                    size and SHA-256 of each file above

:func:`read_checkpoint` checks every file against the manifest before anything is used, so
damaged bytes end with an error naming the file, never with a resumed run on wrong weights.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dikkat import runs
from dikkat.files import check_writable_dir, os_error_of, sha256, write_text
from dikkat.models.io import WEIGHTS_FILE, write_model
from dikkat.training.results import SaveError

STATE_FILE = "trainer_state.pt"
TASK_FILE = "task.json"
LOG_FILE = "log.jsonl"
PLOT_FILE = "loss.png"


def check_out_dir(path: Path, *, overwrite: bool, what: str = "out_dir") -> None:
    """Refuse, before any work, a ``path`` that is a file, unwritable, or already holds a run,
    a model or other files (unless ``overwrite``). Creates nothing."""
    kind = runs.folder_kind(path)
    if kind == "file":
        raise ValueError(f"{what} {path} is a file, not a folder")
    if kind in ("run", "model", "other") and not overwrite:
        hint = " pass --resume to continue it," if kind == "run" else ""
        raise ValueError(
            f"{path} already holds {runs.describe_kind(kind)}:{hint} pass --overwrite "
            f"(overwrite=True) to replace it, or choose another {what}"
        )
    if kind != "missing":
        runs.check_own_names(path)
        runs.refuse_if_held(path)
    if kind == "missing":  # the nearest existing parent must let us create it
        parent = next(p for p in path.absolute().parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{what} {path} cannot be created: {parent} is not writable")
    elif not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} is not writable")


def hold_out_dir(path: Path, what: str = "out_dir") -> runs.RunLock:
    """Before the first write into a run folder, new or resumed: create it (proving it
    writable: a read-only one fails here, not after training), refuse the run's own file names
    taken by folders, and take the run's lock (:func:`dikkat.runs.hold`)."""
    check_writable_dir(path, what)
    runs.check_own_names(path)
    return runs.hold(path)


def prepare_out_dir(path: Path, *, overwrite: bool) -> None:
    """With ``overwrite``, remove what dikkat wrote into ``path`` before (under its lock);
    called once, when a new run starts."""
    if overwrite and runs.folder_kind(path) in ("run", "model"):
        runs.clear(path)


def write_checkpoint(
    out_dir: Path,
    *,
    model: Any,
    tokenizer: Any,
    meta: dict[str, Any],
    state: dict[str, Any],
    made_by: str,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Commit one checkpoint of the run in ``out_dir``; returns its folder. ``weights``: the
    model's full weights where its own state dict holds shards (None: ``model.state_dict()``)."""

    def write(folder: Path) -> None:
        write_model(model, folder, weights)
        tokenizer.save(folder)
        (folder / TASK_FILE).write_text(json.dumps(meta, indent=2))
        torch.save(state, folder / STATE_FILE)

    step = int(state["step"])
    with writing(out_dir, f"the checkpoint of step {step}"):
        return runs.commit_checkpoint(out_dir, step, write, made_by=made_by)


@contextlib.contextmanager
def writing(out_dir: Path, what: str) -> Iterator[None]:
    """Inside, a failed write (``OSError``, or a writer's own error for one, as ``torch.save``
    raises on a full disk: :func:`dikkat.files.os_error_of`) of ``what`` into the run folder
    becomes a :class:`SaveError` naming the checkpoint that is still current."""
    try:
        yield
    except Exception as error:
        e = error if isinstance(error, OSError) else os_error_of(error, out_dir / STATE_FILE)
        if e is None:
            raise
        try:
            saved = int(runs.read_pointer(out_dir)["step"])
        except (ValueError, OSError, KeyError, TypeError):
            saved = None  # no run.json: nothing committed yet (or a run of an older dikkat)
        raise SaveError(e, what, out_dir, saved) from error


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The CPU's random state and, on CUDA, the GPU's (its dropout draws), for a trainer state."""
    state = {"torch_rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved (a GPU's state only on CUDA, where it was saved)."""
    torch.set_rng_state(state["torch_rng"])
    if device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], device)


@dataclass
class SavedRun:
    """A run's current checkpoint, read and checked."""

    folder: Path  # the checkpoint folder (the run folder itself for an older flat run)
    meta: dict[str, Any]  # task.json: {"task": TaskSpec fields, "train": TrainConfig fields}
    state: dict[str, Any]  # trainer_state.pt
    made_by: str | None


def read_checkpoint(run_dir: str | Path, *, verify: bool = True) -> SavedRun:
    """Read the current checkpoint of the run in ``run_dir`` to resume it, every file checked
    first; a run another process trains, or whose log's name a folder took, is refused."""
    d = Path(run_dir)
    if runs.folder_kind(d) != "run":
        raise FileNotFoundError(f"{d} is not a dikkat training run (it has no {runs.RUN_FILE})")
    runs.refuse_if_held(d)  # what a resume would refuse, before every file is read and hashed
    runs.check_own_names(d)
    folder = runs.checkpoint_dir(d)
    if verify:
        runs.verify_checkpoint(folder)  # an older flat run has no manifest: checked below
    task_path, state_path = folder / TASK_FILE, folder / STATE_FILE
    for p in (task_path, state_path):
        if not p.is_file():
            raise FileNotFoundError(f"{folder} has no {p.name}: the run cannot be resumed")
    try:
        meta = json.loads(task_path.read_text())
        if not isinstance(meta, dict) or not {"task", "train"} <= meta.keys():
            raise KeyError("task and train")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError) as e:
        raise ValueError(f"{task_path} is not a valid run description: {e}") from None
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        raise ValueError(f"{state_path} is truncated or corrupt: {e}") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{state_path} is not a dikkat trainer state")
    legacy_sha = state.get("weights_sha256")  # runs of an older dikkat recorded only this
    if verify and legacy_sha is not None and legacy_sha != sha256(folder / WEIGHTS_FILE):
        raise ValueError(
            f"{state_path} belongs to other weights than {WEIGHTS_FILE} (was a save interrupted?)"
        )
    return SavedRun(folder, meta, state, runs.made_by(d))


def write_log(out_dir: Path, history: list[dict[str, Any]]) -> None:
    """Replace ``log.jsonl`` with ``history`` (on resume: lines past the checkpoint go)."""
    with writing(out_dir, LOG_FILE):
        write_text(out_dir / LOG_FILE, "".join(json.dumps(r) + "\n" for r in history))


def append_log(out_dir: Path, record: dict[str, Any]) -> None:
    """One line more in ``log.jsonl`` (append-only: a crash loses at most that line)."""
    with writing(out_dir, LOG_FILE), open(out_dir / LOG_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
