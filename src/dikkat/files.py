"""Files written whole or not at all, and read back verified.

Every file dikkat writes goes through :func:`atomic_write` (or :func:`atomic_write_all`): the
bytes go to a temporary file beside the target, are flushed to the disk (``fsync``), and only
then renamed onto the target name, so a full disk, a crash or a kill at any instant leaves either
the old file or the new one — never half of one. The rename is atomic within one filesystem
(POSIX ``rename(2)``); the directory is flushed after it so the new name survives a power loss.
Files get the permissions of a plain ``open()`` under the user's umask (a temporary file from
:func:`tempfile.mkstemp` would otherwise stay 0600).

A file's :func:`record` (size and SHA-256) is kept beside the data it describes, and
:func:`verify` compares it on the way back in: damaged bytes give an error naming the file,
never a model that loads with silently wrong weights.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Writer = Callable[[str], Any]  # writes the file's content to the path it is given
TMP_SUFFIX = ".tmp"  # temporary files are ".<name>.<random>.tmp" beside their target


def current_umask() -> int:
    try:  # Linux reports it without changing it (no window where other threads see another)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it
    os.umask(mask)
    return mask


def fsync_path(path: str | Path, *, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # a directory that cannot be opened (some platforms): nothing to flush
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some filesystems refuse fsync on a directory; a file must flush
            raise
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Writer) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it onto ``path``."""
    atomic_write_all({Path(path): write})


def atomic_write_all(writes: Mapping[Path, Writer]) -> None:
    """Write every file to a temporary name beside it and flush it; only once all are written,
    rename them into place. A failed write leaves every old file as it was (and no temporary
    file). The renames themselves are one per file: a kill between two of them leaves some new
    files beside some old ones, which is why a checkpoint of several files is committed by one
    pointer instead (:mod:`dikkat.runs`)."""
    tmps: dict[Path, str] = {}
    mode = 0o666 & ~current_umask()
    try:
        for path, write in writes.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
            os.close(fd)
            tmps[path] = tmp
            try:
                write(tmp)
            except OSError:
                raise
            except Exception as error:  # a writer that reports a failed write its own way
                failed = os_error_of(error, tmp)
                if failed is None:
                    raise
                raise failed from error
            os.chmod(tmp, mode)
            fsync_path(tmp)
        for path, tmp in tmps.items():
            os.replace(tmp, path)
        for parent in {Path(p).parent for p in tmps}:
            fsync_path(parent, directory=True)
    except BaseException:
        for tmp in tmps.values():
            Path(tmp).unlink(missing_ok=True)
        raise


def os_error_of(error: Exception, path: str | Path) -> OSError | None:
    """The ``OSError`` behind a writer's own exception, or None when there is none to find.

    safetensors reports a failed write as ``SafetensorError("… (os error 28)")`` and
    ``torch.save`` as a ``RuntimeError`` of its zip writer that names no cause, so a full disk
    would end in a traceback instead of the one line an ``OSError`` gets: the error number is
    read from the message; else a file that reached the process's limit on a file's size
    (``ulimit -f``, ``RLIMIT_FSIZE``: a write past it fails with ``EFBIG``, getrlimit(2)) is
    taken to be the cause, else a file system with no free block.
    """
    found = re.search(r"os error (\d+)", str(error))
    if found:
        number = int(found.group(1))
        return OSError(number, os.strerror(number), str(path))
    limit = _size_limit_reached(path)
    if limit is not None:
        why = f"{os.strerror(errno.EFBIG)}: it reached the limit on a file's size (ulimit -f)"
        return OSError(errno.EFBIG, f"{why}, {limit} bytes", str(path))
    try:
        stats = os.statvfs(Path(path).parent)
    except (OSError, AttributeError):  # no statvfs on this platform, or the folder is gone
        return None
    if stats.f_bavail == 0:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


def _size_limit_reached(path: str | Path) -> int | None:
    """The soft ``RLIMIT_FSIZE`` in bytes if the file at ``path`` has reached it, else None."""
    try:
        import resource  # POSIX only

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        size = os.path.getsize(path)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or size < soft:
        return None
    return soft


def write_text(path: str | Path, text: str) -> None:
    """Atomically replace ``path`` with ``text`` (UTF-8)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def sha256(path: str | Path) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def record(path: str | Path) -> dict[str, Any]:
    """What :func:`verify` checks a file against later: its size and SHA-256."""
    return {"bytes": os.path.getsize(path), "sha256": sha256(path)}


def verify(path: str | Path, expected: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming ``path`` unless its size and SHA-256 match ``expected``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (its checkpoint lists it)")
    size = os.path.getsize(path)
    if "bytes" in expected and size != expected["bytes"]:
        raise ValueError(
            f"{path} is damaged: {size:,} bytes where {int(expected['bytes']):,} were written "
            "(truncated or replaced)"
        )
    if sha256(path) != expected.get("sha256"):
        raise ValueError(
            f"{path} is damaged: its SHA-256 differs from the one recorded when it was written "
            "(pass verify=False / --no-verify to load it anyway)"
        )


def check_writable_dir(path: str | Path, what: str = "--out") -> Path:
    """Make sure ``path`` is (or can become) a folder this process can write files into, before
    any long work starts; ``ValueError`` naming ``what`` otherwise. Creates the folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what} {path} is not writable: {e.strerror or e}") from None
    return path


def cache_dir() -> Path:
    """Where dikkat keeps what it makes once and reuses (docs/models.md, "What is cached
    where"): ``$DIKKAT_CACHE``, else ``$XDG_CACHE_HOME/dikkat``, else ``~/.cache/dikkat``."""
    if os.environ.get("DIKKAT_CACHE"):
        return Path(os.environ["DIKKAT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dikkat"
