"""Saving and loading models: safetensors weights + a JSON config, written together.

A model folder ``path/`` holds ``config.json`` (the frozen config dataclass, the model's class
name, the dikkat version, and the size and SHA-256 of the weights) and ``model.safetensors``.
Both are written to temporary names and renamed into place only once both are written
(:func:`dikkat.files.atomic_write_all`), so a failed save never destroys the previous model nor
pairs new weights with an old config; a load checks the weights against the recorded SHA-256.

``load`` also accepts a training run's folder (:mod:`dikkat.runs`) and reads its current
checkpoint. ``save`` never replaces a model, a run or foreign files without ``overwrite=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dikkat import runs
from dikkat.files import atomic_write_all, record, verify
from dikkat.version import __version__

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

M = TypeVar("M", bound="SaveLoad")


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


def load_checked(
    model: nn.Module, tensors: dict[str, torch.Tensor], source: str, *, assign: bool = False
) -> None:
    """Load ``tensors`` into ``model`` after checking that every name and shape fits.

    Parameters tied to another one (``model.is_tied(name)``) may be absent: loading the other
    fills them (with ``assign=True``, which makes the given tensors the parameters, e.g. of a
    model built on the meta device, the caller ties them again). Raises ``ValueError`` naming
    what is missing, unexpected or of the wrong shape.
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
    model.load_state_dict(tensors, strict=False, assign=assign)  # strict except for tied names


class SaveLoad:
    """Mixin for a model with a frozen-dataclass ``config`` and ``__init__(config)``."""

    config: Any
    config_class: type

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into folder ``path``, together.

        A folder that already holds a model, a training run or other files is left alone
        (``ValueError``) unless ``overwrite=True``; then a run's checkpoints, log and plot are
        removed once the model is written (files dikkat did not write are kept).
        """
        path = Path(path)
        kind = runs.folder_kind(path)
        if kind == "file":
            raise ValueError(f"cannot save a model into {path}: it is a file, not a folder")
        if kind in ("run", "model", "other") and not overwrite:
            raise ValueError(
                f"{path} already holds {runs.describe_kind(kind)}; pass overwrite=True to "
                "replace it, or save into another folder"
            )
        write_model(self, path)  # type: ignore[arg-type]
        if kind == "run":
            runs.clear(path, keep_model=True)  # the run is replaced by this model
        return path

    @classmethod
    def load(
        cls: type[M], path: str | os.PathLike, *, map_location: str = "cpu", verify: bool = True
    ) -> M:
        """Rebuild the model saved in folder ``path`` (a model folder, or a training run's
        current checkpoint); clear errors for missing, damaged or mismatched files.

        ``verify`` checks the weights against the SHA-256 recorded when they were written
        (reading them twice; pass False to skip that for a large model you trust).
        """
        path = runs.checkpoint_dir(path)
        config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
        for p in (config_path, weights_path):
            if not p.is_file():
                raise FileNotFoundError(f"checkpoint {path} has no {p.name}")
        try:
            meta = json.loads(config_path.read_text())
            config_fields = meta["config"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{config_path} is not a valid {cls.__name__} config: {e}") from None
        if meta.get("model") != cls.__name__:
            raise ValueError(f"{path} holds a {meta.get('model')!r}, not a {cls.__name__}")
        try:
            config = cls.config_class(**config_fields)
        except TypeError as e:
            raise ValueError(f"{config_path} is not a valid {cls.__name__} config: {e}") from None
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from None
        check_fits(cls, config, str(config_path))  # before a table of max_len rows is allocated
        if verify:
            _verify_weights(path, meta)
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


def write_model(
    model: SaveLoad, folder: Path, tensors: dict[str, torch.Tensor] | None = None
) -> None:
    """Write ``model``'s two files into ``folder`` (no checks of what is there: see ``save``).

    ``tensors`` replaces the model's own state dict (the full weights gathered from a sharded
    model, tied names left out); None writes ``model.state_dict()``, each tied tensor once.
    """
    if tensors is None:
        tensors = _state_for_saving(model)  # type: ignore[arg-type]
    written: dict[str, Any] = {}

    def weights(tmp: str) -> None:
        save_file(tensors, tmp)
        written.update(record(tmp))

    def config(tmp: str) -> None:  # runs after weights(): atomic_write_all keeps the order
        meta = {
            "model": type(model).__name__,
            "dikkat_version": __version__,
            "config": dataclasses.asdict(model.config),
            "weights": written,
        }
        Path(tmp).write_text(json.dumps(meta, indent=2))

    atomic_write_all({folder / WEIGHTS_FILE: weights, folder / CONFIG_FILE: config})


def _verify_weights(folder: Path, meta: dict[str, Any]) -> None:
    """The weights against a checkpoint's manifest, else the record in ``config.json`` (older
    dikkat versions wrote neither: nothing to check)."""
    if runs.verify_checkpoint(folder, (CONFIG_FILE, WEIGHTS_FILE)):
        return
    expected = meta.get("weights")
    if isinstance(expected, dict) and "sha256" in expected:
        verify(folder / WEIGHTS_FILE, expected)


def available_memory() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable, capped by a cgroup
    (container) limit; None where neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


class _NoRandomFills(TorchFunctionMode):
    """Skips ``normal_`` on meta tensors: it writes nothing there, but its meta form runs through
    ``torch._refs``, whose wrapper imports ``torch._dynamo`` and with it triton (~90 MiB
    resident, ~1 s) in a process that never compiles."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        filled = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
        if func in _FILLS and isinstance(filled, Tensor) and filled.is_meta:
            return filled
        return func(*args, **kwargs)


_FILLS = (torch.nn.init.normal_, Tensor.normal_)


@contextlib.contextmanager
def meta_modules() -> Iterator[None]:
    """Modules built inside hold meta tensors (no memory): to count their parameters, or to be
    given their weights by a loader. Their random initialisation is skipped, as it means
    nothing there."""
    with torch.device("meta"), _NoRandomFills():
        yield


def model_bytes(cls: type, config: Any) -> int:
    """The bytes of the parameters and buffers (position tables) that ``cls(config)``
    allocates, counted on the meta device: nothing is allocated. Not counted: what building
    them needs for a moment, and everything a forward pass needs."""
    with meta_modules():
        model = cls(config)
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def check_fits(cls: type, config: Any, source: str) -> None:
    """Refuse (``ValueError`` naming ``source``, and ``max_len`` when it is the cause) a config
    whose model would not fit in the memory available now, instead of the allocator's error."""
    need, have = model_bytes(cls, config), available_memory()
    if have is None or need <= have:
        return
    gib = 2**30
    cause = ""
    length = getattr(config, "max_len", None)
    if isinstance(length, int) and length > 1:
        try:
            by_length = need - model_bytes(cls, dataclasses.replace(config, max_len=1))
        except (TypeError, ValueError):  # a config that refuses max_len 1
            by_length = 0
        if by_length > need / 2:
            cause = f"; max_len {length:,} alone takes {by_length / gib:,.1f} GiB of it"
    raise ValueError(
        f"{source}: a {cls.__name__} of this config needs {need / gib:,.1f} GiB for its weights "
        f"and tables, more than the {have / gib:,.1f} GiB available{cause}"
    )
