"""The folder of compiled steps (:mod:`dikkat.models.aot_package`) kept in order: one build of
a package at a time across processes (:func:`one_build`), and the packages a build makes
useless removed (:func:`prune`)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LAYOUT", "one_build", "prune"]

LAYOUT = 2  # a package's layout and its record's (aot_package.VERSION); a change needs a new one


@contextlib.contextmanager
def one_build(package: Path) -> Iterator[None]:
    """Hold ``package``'s lock file (``.lock`` beside it; ``fcntl.flock``, exclusive) while it is
    looked for and built, so that of two processes wanting one package the second waits — saying
    so — and then loads what the first built instead of compiling it again. Where there is no
    ``flock``, or the lock file cannot be made (the build then says why), no lock is held."""
    try:
        import fcntl
    except ImportError:  # not on every system
        yield
        return
    try:
        package.parent.mkdir(parents=True, exist_ok=True)
        lock = package.with_suffix(".lock").open("a")
    except OSError:
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("dikkat: another process is compiling this step; waiting for it …",
                  file=sys.stderr, flush=True)  # fmt: skip
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prune(folder: Path, lineage: str, keep: Path) -> int:
    """Remove from ``folder`` the packages (and records) of an older layout, and those of
    ``lineage`` other than ``keep``: what a build of ``keep`` makes useless. Returns the bytes
    freed; a file that cannot be read or removed is left (another process may be writing
    it)."""
    freed = 0
    for entry_path in folder.glob("*.json"):
        package = entry_path.with_suffix(".pt2")
        if package == keep:
            continue
        try:
            entry = json.loads(entry_path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(entry, dict) or (
            entry.get("version") == LAYOUT and entry.get("lineage") != lineage
        ):
            continue
        # the package first (a record alone is rebuilt), the lock file last
        for path in (package, entry_path, package.with_suffix(".lock")):
            with contextlib.suppress(OSError):
                size = path.stat().st_size
                path.unlink()
                freed += size
    return freed
