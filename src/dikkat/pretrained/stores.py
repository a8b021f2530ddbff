"""The places other tools keep the models people already have, read where they lie: the Hugging
Face hub's cache (``huggingface-cli download``, ``from_pretrained``), ollama's store
(``ollama pull``), and LM Studio's models folder. Nothing is downloaded or copied.

- **Hugging Face**: a hub id, ``org/name``, in the cache that ``HF_HUB_CACHE``, ``HF_HOME`` or
  ``XDG_CACHE_HOME`` name (``~/.cache/huggingface/hub`` by default), through
  ``huggingface_hub`` with ``local_files_only`` (its cache layout is its own to say). A
  snapshot with ``config.json`` is a model folder; one of GGUF files (a ``-GGUF`` repository) is
  picked by a tag after a colon, ``org/name:Q4_K_M``, as ``llama-server -hf`` takes it.
- **ollama**: ``name[:tag]``, ``namespace/name[:tag]`` or ``host/namespace/name[:tag]`` (``tag``
  ``latest``, namespace ``library`` and host ``registry.ollama.ai`` where left out), in
  ``OLLAMA_MODELS`` or ``~/.ollama/models``: the manifest names the model's layer, a GGUF file
  kept as ``blobs/sha256-…`` (docs/api.md and the manifest format of ollama's repository).
- **LM Studio**: ``publisher/repository[/file.gguf]`` under ``~/.lmstudio/models`` (or the older
  ``~/.cache/lm-studio/models``), a repository's GGUF files picked by a tag as above.

A prefix chooses the store: ``hf:``, ``ollama:``, ``lmstudio:``; without one they are asked in
that order.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Stored",
    "find",
    "hf_hub_cache",
    "lmstudio_dirs",
    "ollama_dir",
    "stored_models",
    "where",
]

STORES = ("hf", "ollama", "lmstudio")
_MODEL_LAYER = "application/vnd.ollama.image.model"
_OLLAMA_HOST, _OLLAMA_NAMESPACE = "registry.ollama.ai", "library"


@dataclass(frozen=True)
class Stored:
    """A model found in a store: ``kind`` "gguf" (``path`` is the file) or "hf" (a folder);
    ``name`` is what finds it again (``dikkat chat NAME``)."""

    store: str
    name: str
    kind: str
    path: Path


def hf_hub_cache() -> Path:
    """The hub cache's folder, by huggingface_hub's own rule (read at each call)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = (
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    )
    return Path(home).expanduser() / "hub"


def ollama_dir() -> Path:
    """ollama's store: ``OLLAMA_MODELS``, else ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders, the current one first."""
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def where() -> str:
    """Where :func:`find` looks, for a message."""
    lm = " or ".join(str(p) for p in lmstudio_dirs())
    return (
        f"the Hugging Face cache ({hf_hub_cache()}), ollama's store ({ollama_dir()}), "
        f"LM Studio's folder ({lm})"
    )


def find(text: str) -> Stored | None:
    """The model ``text`` names in a store (see the module doc), or None."""
    store, _, rest = text.partition(":")
    stores = (store,) if store in STORES and rest else STORES
    name = rest if store in STORES and rest else text
    for each in stores:
        found = {"hf": _in_hf, "ollama": _in_ollama, "lmstudio": _in_lmstudio}[each](name)
        if found is not None:
            return found
    return None


def _tagged(name: str) -> tuple[str, str | None]:
    """``repo:TAG`` → (repo, TAG); a name without a colon has no tag."""
    repo, _, tag = name.partition(":")
    return repo, tag or None


def _pick_gguf(files: list[Path], tag: str | None, name: str) -> Path:
    """The one GGUF file of ``files`` whose name holds ``tag`` (any case), or the only one."""
    chosen = files if tag is None else [f for f in files if tag.lower() in f.name.lower()]
    if len(chosen) == 1:
        return chosen[0]
    shown = ", ".join(f.name for f in files[:8])
    if not chosen:
        raise ValueError(f"{name}: no GGUF file named with {tag!r}; it holds {shown}")
    raise ValueError(f"{name} holds several GGUF files; choose one with name:TAG ({shown})")


def _folder_model(store: str, name: str, folder: Path, tag: str | None) -> Stored | None:
    if tag is None and (folder / "config.json").is_file():
        return Stored(store, name, "hf", folder)
    ggufs = sorted(p for p in folder.rglob("*.gguf") if p.is_file())
    if not ggufs:
        return None
    return Stored(store, name, "gguf", _pick_gguf(ggufs, tag, name))


def _in_hf(name: str) -> Stored | None:
    repo, tag = _tagged(name)
    if repo.count("/") != 1 or not all(repo.split("/")):
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        folder = snapshot_download(repo, cache_dir=hf_hub_cache(), local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return _folder_model("hf", name, Path(folder), tag)


def _ollama_manifest(name: str) -> Path | None:
    repo, tag = _tagged(name)
    parts = repo.split("/")
    if not all(parts) or ".." in parts or len(parts) > 3 or not re.fullmatch(r"[\w.\-/]+", repo):
        return None
    if len(parts) < 3:
        parts = [_OLLAMA_HOST, *([_OLLAMA_NAMESPACE] if len(parts) == 1 else []), *parts]
    path = ollama_dir() / "manifests" / Path(*parts) / (tag or "latest")
    return path if path.is_file() else None


def _in_ollama(name: str) -> Stored | None:
    manifest = _ollama_manifest(name)
    if manifest is None:
        return None
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(x["digest"] for x in layers if x.get("mediaType") == _MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise ValueError(f"ollama's manifest {manifest} names no model layer") from None
    blob = ollama_dir() / "blobs" / str(digest).replace(":", "-")
    if not blob.is_file():
        raise ValueError(f"ollama's model {name!r} names {blob}, which is missing")
    return Stored("ollama", name, "gguf", blob)


def _in_lmstudio(name: str) -> Stored | None:
    repo, tag = _tagged(name)
    if not repo or ".." in Path(repo).parts:
        return None
    for base in lmstudio_dirs():
        path = base / repo
        if path.is_file() and path.suffix.lower() == ".gguf":
            return Stored("lmstudio", name, "gguf", path)
        if path.is_dir():
            found = _folder_model("lmstudio", name, path, tag)
            if found is not None:
                return found
    return None


def stored_models() -> Iterator[Stored]:
    """Every model in the stores, each under a name that finds it again."""
    yield from _hf_models()
    yield from _ollama_models()
    for base in lmstudio_dirs():
        if base.is_dir():
            for path in sorted(base.rglob("*.gguf")):
                yield Stored("lmstudio", path.relative_to(base).as_posix(), "gguf", path)


def _hf_models() -> Iterator[Stored]:
    cache = hf_hub_cache()
    if not cache.is_dir():
        return
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:
        return
    for repo in sorted(scan_cache_dir(cache).repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        latest = max(repo.revisions, key=lambda r: r.last_modified)
        folder = Path(latest.snapshot_path)
        if (folder / "config.json").is_file():
            yield Stored("hf", repo.repo_id, "hf", folder)
        ggufs = sorted(folder.rglob("*.gguf"))
        for path in ggufs:
            name = repo.repo_id if len(ggufs) == 1 else f"{repo.repo_id}:{path.stem}"
            yield Stored("hf", name, "gguf", path)


def _ollama_models() -> Iterator[Stored]:
    root = ollama_dir() / "manifests"
    if not root.is_dir():
        return
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()):
        host, *path = manifest.relative_to(root).parts
        *repo, tag = path
        if host == _OLLAMA_HOST and repo[:1] == [_OLLAMA_NAMESPACE]:
            repo = repo[1:]
        name = "/".join(([] if host == _OLLAMA_HOST else [host]) + repo) + f":{tag}"
        try:
            found = _in_ollama(name)
        except ValueError:
            continue
        if found is not None:
            yield found
