"""A GGUF file's matrices as dikkat repacks them, kept on disk after the first load: later loads
map them in place (``mmap``) instead of repacking every block again.

One cache entry is two files in ``packed/`` of dikkat's cache (:func:`dikkat.files.cache_dir`):
``<stem>-<key>.bin``, the tensors' bytes one after another (each at a multiple of 64 bytes), and
``<stem>-<key>.json``, the index (each GGUF tensor's layout and where its parts lie). The key is
a hash of what makes the entry valid: the GGUF file's size, modification time and header bytes,
the layout's :data:`VERSION`, the byte order, and the source of the code that repacks (the
weight formats, the families' fix-ups, the loader). The ``.bin`` is written while the first load
reads the file and renamed into place; the index is written after it (flushed to the disk),
with the ``.bin``'s size and SHA-256, so an entry without its index (a crash, a full disk) is
never read, and one whose ``.bin`` no longer matches its index is repacked and written again,
with a line on stderr. Writing an entry removes the older entries of the same file name. Files
smaller than :data:`MIN_BYTES` are not cached: repacking them costs less than the files would.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import torch

from dikkat.files import atomic_write, cache_dir, current_umask
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.weights.packed import PackedWeight

__all__ = ["MIN_BYTES", "VERSION", "PackedCache"]

VERSION = 1  # the repacked layout (dikkat.weights.packed and groups); a change needs a new one
MIN_BYTES = 32 * 2**20  # smaller GGUF files are repacked at every load
_ALIGN = 64
_PARTS = ("values", "scale", "offset", "super_scale", "super_offset")
_DTYPES = {str(d): d for d in (torch.uint8, torch.int8, torch.float16, torch.float32)}


class PackedCache:
    """The cache entry of one open GGUF file: :meth:`read` its repacked tensors, or
    :meth:`writer` to keep them as a load repacks them."""

    def __init__(self, file: GGUFFile, folder: Path | None = None) -> None:
        stat = file.path.stat()
        digest = hashlib.sha256()
        for part in (VERSION, sys.byteorder, stat.st_size, stat.st_mtime_ns):
            digest.update(f"{part}\0".encode())
        digest.update(file.header_bytes())
        digest.update(_code())
        self.key = digest.hexdigest()[:24]
        self.folder = cache_dir() / "packed" if folder is None else Path(folder)
        self.stem = file.path.stem
        name = f"{self.stem}-{self.key}"
        self.data, self.index = self.folder / f"{name}.bin", self.folder / f"{name}.json"
        self._map: mmap.mmap | None = None

    @staticmethod
    def wanted(file: GGUFFile) -> bool:
        """Whether ``file`` is large enough to be cached (:data:`MIN_BYTES`)."""
        return file.path.stat().st_size >= MIN_BYTES

    def read(self) -> dict[str, PackedWeight] | None:
        """The cached tensors by GGUF name, their bytes mapped from the ``.bin`` in place; None
        where there is no whole entry."""
        try:
            index = json.loads(self.index.read_text())
            size = self.data.stat().st_size
        except (OSError, ValueError):
            return None
        if not isinstance(index, dict) or index.get("key") != self.key or size == 0:
            return None
        with self.data.open("rb") as f:  # private and writable: torch takes it without a copy
            self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        data = torch.frombuffer(self._map, dtype=torch.uint8)
        whole = (
            size == index.get("bytes")
            and _listing_hash(index.get("tensors")) == index.get("tensors_sha256")
            and self._sha256(size) == index.get("sha256")
        )
        if not whole:
            print(f"dikkat: {self.data} is damaged (it differs from its index): repacking",
                  file=sys.stderr, flush=True)  # fmt: skip
            return None
        return {name: _weight(data, entry) for name, entry in index["tensors"].items()}

    def _sha256(self, size: int) -> str:
        """The mapped ``.bin``'s SHA-256, read a slice at a time, each slice's pages dropped
        after it (a check must not hold the whole file resident)."""
        assert self._map is not None
        digest, chunk = hashlib.sha256(), 64 * 2**20
        with memoryview(self._map) as view:
            for at in range(0, size, chunk):
                digest.update(view[at : at + chunk])
                if hasattr(mmap, "MADV_DONTNEED"):
                    self._map.madvise(mmap.MADV_DONTNEED, at, min(chunk, size - at))
        return digest.hexdigest()

    def let_go(self) -> None:
        """Drop the mapped pages from this process's resident memory once the model holds its
        weights: what it multiplies in place comes back from the page cache as it is read, and
        what it copied (fused q/k/v, gate/up) is not read again."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def writer(self) -> CacheWriter:
        """A writer that keeps the tensors handed to it, for :meth:`read` to give back."""
        return CacheWriter(self)


class CacheWriter:
    """Appends repacked tensors to a temporary ``.bin`` beside the entry; :meth:`commit` puts
    the entry in place, :meth:`discard` leaves nothing behind. A disk that refuses (no room, no
    permission) ends the writing quietly: the load goes on, and the next one repacks again."""

    def __init__(self, cache: PackedCache) -> None:
        self.cache = cache
        self.digest = hashlib.sha256()
        self.tensors: dict[str, dict[str, Any]] = {}
        self.out: IO[bytes] | None = None
        try:
            cache.folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{cache.data.name}.", dir=cache.folder)
        except OSError:
            return
        self.tmp = Path(name)
        self.out = os.fdopen(fd, "wb")

    def add(self, name: str, p: PackedWeight) -> None:
        """Append ``p``'s tensors (GGUF tensor ``name``)."""
        if self.out is None:
            return
        parts = {}
        try:
            for part in _PARTS:
                t: torch.Tensor | None = getattr(p, part)
                if t is None:
                    continue
                self._write(b"\0" * (-self.out.tell() % _ALIGN))
                t = t.contiguous()
                parts[part] = [self.out.tell(), str(t.dtype), list(t.shape)]
                self._write(t.reshape(-1).view(torch.uint8).numpy())
        except OSError:
            self.discard()
            return
        self.tensors[name] = {
            "bits": p.bits, "block": p.block, "zero": p.zero, "kind": p.kind,
            "grouped": p.grouped, "parts": parts,
        }  # fmt: skip

    def _write(self, data: Any) -> None:
        assert self.out is not None
        self.out.write(data)
        self.digest.update(data)

    def commit(self) -> None:
        """Rename the ``.bin`` into place, then write the index; remove the older entries of
        the same file name."""
        if self.out is None:
            return
        c = self.cache
        try:
            size = self.out.tell()
            # not flushed to the disk: a crash that leaves the .bin half written leaves it
            # unlike the SHA-256 of its index, and the next load repacks
            self.out.close()
            os.chmod(self.tmp, 0o666 & ~current_umask())  # as a plain open() would make it
            os.replace(self.tmp, c.data)
            index = {
                "key": c.key, "bytes": size, "sha256": self.digest.hexdigest(),
                "tensors": self.tensors, "tensors_sha256": _listing_hash(self.tensors),
            }  # fmt: skip
            atomic_write(c.index, lambda tmp: Path(tmp).write_text(json.dumps(index)))
        except OSError:
            self.discard()
            return
        entry = re.compile(rf"{re.escape(c.stem)}-[0-9a-f]{{24}}\.(bin|json)")
        for old in c.folder.iterdir():
            if entry.fullmatch(old.name) and old not in (c.data, c.index):
                old.unlink(missing_ok=True)

    def discard(self) -> None:
        """Remove the temporary ``.bin``; nothing more is written."""
        if self.out is not None:
            self.out.close()
            self.tmp.unlink(missing_ok=True)
        self.out = None


def _listing_hash(tensors: Any) -> str:
    """The SHA-256 of an index's listing of tensors (the index checks itself too)."""
    return hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()


@functools.cache
def _code() -> bytes:
    """The source of everything that decides the repacked bytes — the weight formats, the
    families' fix-ups, the loader and this cache — so that a change to any of it keys new
    entries instead of reading old ones."""
    root = Path(__file__).resolve().parents[1]  # dikkat/
    files = [*(root / "weights").glob("*.py"), *(root / "pretrained" / "families").glob("*.py")]
    files += [root / "pretrained" / "loading.py", Path(__file__).resolve()]
    return b"\0".join(f.read_bytes() for f in sorted(files))


def _weight(data: torch.Tensor, entry: dict[str, Any]) -> PackedWeight:
    """A cached tensor: its parts as views of ``data`` (the mapped ``.bin``)."""

    def part(name: str) -> torch.Tensor | None:
        where = entry["parts"].get(name)
        if where is None:
            return None
        start, dtype, shape = where
        dtype = _DTYPES[dtype]
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        return data[start : start + n].view(dtype).view(shape)

    return PackedWeight(
        part("values"), part("scale"), part("offset"), entry["zero"], entry["bits"],  # type: ignore[arg-type]
        entry["block"], entry["kind"], entry["grouped"], part("super_scale"), part("super_offset"),
    )  # fmt: skip
