"""A training run's folder, where a checkpoint of many files is switched in by one rename.

Layout::

    run.json              the pointer: the name of the current checkpoint (and who made the run)
    checkpoint-000200/    config.json, model.safetensors, tokenizer_config.json | tokenizer.json,
                          task.json, trainer_state.pt, manifest.json (size + SHA-256 of each)
    log.jsonl, loss.png   the log and the loss curves
    .lock                 held (``flock``) by the one trainer writing the run: :func:`hold`

A save writes a complete new checkpoint folder under a temporary name, flushes it, renames it to
its final name, and only then replaces ``run.json`` (:func:`dikkat.files.atomic_write`). That
replacement is the commit: a kill or a full disk before it leaves the previous checkpoint
current and whole; after it, the new one. Older checkpoint folders are removed after the commit.
Reading a run goes through :func:`checkpoint_dir`, so ``GPT.load("runs/gpt")`` works on a run
folder as on a model folder, and :func:`verify_checkpoint` checks every file against the
manifest.

One trainer at a time writes a run: :func:`hold` takes an advisory lock on ``.lock`` (the
kernel releases it when the process ends, however it ends) and writes the holder's process id
into it, so a second trainer is refused naming that process. Checkpoints are checked against
their manifest; a checkpoint without one is refused like a damaged one.

A folder with ``config.json`` and no ``run.json`` is a model saved with ``save()`` (or a run of
an older dikkat, which kept its files flat beside ``task.json``); both still load.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from dikkat.files import TMP_SUFFIX, atomic_write, current_umask, fsync_path, record, verify

RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_PREFIX = "checkpoint-"
RUN_FORMAT = "dikkat run"
LEGACY_RUN_FILE = "task.json"  # a run of an older dikkat: its files lie flat beside this one
# what dikkat itself writes into a model or run folder (clear() removes only these)
FLAT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "task.json",
    "trainer_state.pt",
)
RUN_EXTRAS = ("log.jsonl", "loss.png")
LOCK_FILE = ".lock"  # never removed: removing a lock file lets two processes lock two files
# set by `dikkat train --nproc` for its ranks to its own process id: it holds the run's lock for
# them (a rank is another process, which the launcher's lock would refuse), and they end with it
HOLDER_ENV = "DIKKAT_LAUNCHER_PID"

try:  # POSIX; elsewhere a run is not locked
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

Kind = Literal["missing", "file", "empty", "run", "model", "other"]


def folder_kind(path: str | Path) -> Kind:
    """What is at ``path``: nothing, a file, an empty folder, a run, a model, or other files."""
    path = Path(path)
    if not path.exists():
        return "missing"
    if not path.is_dir():
        return "file"
    if (path / RUN_FILE).is_file() or (path / LEGACY_RUN_FILE).is_file():
        return "run"
    if (path / "config.json").is_file():
        return "model"
    return "other" if any(p.name != LOCK_FILE for p in path.iterdir()) else "empty"


def describe_kind(kind: Kind) -> str:
    return {
        "run": "a training run",
        "model": "a saved model",
        "other": "files that dikkat did not write",
        "file": "a file",
    }.get(kind, "nothing")


def check_own_names(run_dir: str | Path) -> None:
    """Refuse, before any training, a run folder where a name the run writes (``run.json``,
    ``log.jsonl``, ``loss.png``, ``.lock``) is taken by something that is not a file."""
    for name in (RUN_FILE, *RUN_EXTRAS, LOCK_FILE):
        path = Path(run_dir) / name
        if path.exists() and not path.is_file():
            what = "a folder" if path.is_dir() else "not a file"
            raise ValueError(f"{path} is {what}: the run writes its {name} there (move it away)")


class RunLock:
    """The lock of a run folder, taken by :func:`hold`; :meth:`release`, the lock's garbage
    collection or the end of the process frees it."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd  # fd None: held by this process's launcher, or no flock

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


# the locks this process holds, by the lock file's (device, inode): a second hold() of a run
# this process holds shares the lock (flock would refuse it, as if another process held it)
_HELD: weakref.WeakValueDictionary[tuple[int, int], RunLock] = weakref.WeakValueDictionary()


def _holder(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # being written this instant, or damaged


def _in_use(run_dir: str | Path, holder: int | None) -> str:
    who = f"process {holder}" if holder is not None else "another process"
    return (
        f"{run_dir} is being trained by {who}: one trainer at a time writes a run (wait for it "
        "to end, or stop it)"
    )


def refuse_if_held(run_dir: str | Path) -> None:
    """``ValueError`` naming the holder if another process holds the run's lock now: the early
    refusal, before slow work, of what :func:`hold` would refuse. Changes nothing on disk."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)  # flock needs no write access
    except OSError:
        return  # no lock file: nobody holds it
    try:
        st = os.fstat(fd)
        if fcntl is None or (st.st_dev, st.st_ino) in _HELD:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            mine = holder is not None and str(holder) == os.environ.get(HOLDER_ENV)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and not mine:
                raise ValueError(_in_use(run_dir, holder)) from None
    finally:
        os.close(fd)  # and with it the probe's own lock


def _flock(fd: int, tries: int = 5) -> None:
    """An exclusive flock, tried a few times over 0.1 s: a probe (:func:`refuse_if_held`) holds
    the lock for an instant, which must not look like a trainer holding it."""
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == tries - 1:
                raise
            time.sleep(0.025)


def hold(run_dir: str | Path) -> RunLock:
    """Take the run folder's lock for this process; ``ValueError`` naming the process that
    holds it, or naming the folder if it cannot be written.

    The lock is ``flock(2)`` on ``run_dir/.lock``: advisory (only dikkat's trainers ask for it)
    and released by the kernel when the holder exits, however it exits, so a crashed trainer
    leaves a stale file that the next one takes over. Within one process the lock is shared.
    A process whose launcher holds the lock for it (:data:`HOLDER_ENV`) goes on without one."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask applies
        st = os.fstat(fd)
    except OSError as e:
        raise ValueError(f"{run_dir} is not writable: {e.strerror or e}") from None
    held = _HELD.get((st.st_dev, st.st_ino))
    if held is not None and held._fd is not None:
        os.close(fd)
        return held
    if fcntl is None:  # pragma: no cover - Windows
        return RunLock(path, fd)
    try:
        _flock(fd)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            warnings.warn(  # a filesystem without flock (some network mounts)
                f"{path} cannot be locked ({e.strerror}): nothing stops a second trainer from "
                "writing this run at the same time",
                stacklevel=2,
            )
            return RunLock(path, None)
        if holder is not None and str(holder) == os.environ.get(HOLDER_ENV):
            return RunLock(path, None)
        raise ValueError(_in_use(run_dir, holder)) from None
    lock = RunLock(path, fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        lock.release()
        raise ValueError(f"{run_dir} cannot be written: {e.strerror or e}") from None
    _HELD[(st.st_dev, st.st_ino)] = lock
    return lock


def release(run_dir: str | Path) -> None:
    """Let go of the lock this process holds on the run in ``run_dir`` (a Trainer keeps it from
    its first write until it is garbage collected, or the process ends); a no-op otherwise."""
    try:
        st = os.stat(Path(run_dir) / LOCK_FILE)
    except OSError:
        return
    held = _HELD.pop((st.st_dev, st.st_ino), None)
    if held is not None:
        held.release()


def read_pointer(run_dir: str | Path) -> dict[str, Any]:
    """The parsed ``run.json`` of a run folder; ``ValueError`` naming it if it is damaged."""
    path = Path(run_dir) / RUN_FILE
    try:
        pointer = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is unreadable or damaged: {e}") from None
    if (
        not isinstance(pointer, dict)
        or pointer.get("format") != RUN_FORMAT
        or not isinstance(pointer.get("checkpoint"), str)
        or "/" in pointer["checkpoint"]
        or not pointer["checkpoint"].startswith(CHECKPOINT_PREFIX)
    ):
        raise ValueError(f"{path} is not a dikkat run pointer: {pointer!r:.200}")
    return pointer


def checkpoint_dir(path: str | Path) -> Path:
    """The folder that holds the files of ``path``'s current checkpoint: through ``run.json`` for
    a run, ``path`` itself for a model folder (or a run of an older dikkat)."""
    path = Path(path)
    if not (path / RUN_FILE).is_file():
        return path
    name = read_pointer(path)["checkpoint"]
    target = path / name
    if not target.is_dir():
        raise FileNotFoundError(f"{path / RUN_FILE} names {name}, which is missing from {path}")
    return target


def made_by(run_dir: str | Path) -> str | None:
    """Who made the run in ``run_dir`` (``"dikkat demo"``, ``"dikkat train"``, …), if recorded."""
    if not (Path(run_dir) / RUN_FILE).is_file():
        return None
    value = read_pointer(run_dir).get("made_by")
    return value if isinstance(value, str) else None


def commit_checkpoint(
    run_dir: str | Path, step: int, write: Callable[[Path], None], *, made_by: str
) -> Path:
    """Write a new checkpoint with ``write(folder)`` and make it the run's current one.

    ``write`` fills a fresh folder no reader can see yet; then the files are flushed, listed
    with their sizes and SHA-256 in ``manifest.json``, the folder renamed to
    ``checkpoint-<step>``, and ``run.json`` replaced to point at it. Returns the new folder.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_PREFIX}{step:06d}.", dir=run_dir))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700
        write(tmp)
        manifest = {}
        for f in sorted(tmp.iterdir()):
            fsync_path(f)
            manifest[f.name] = record(f)
        (tmp / MANIFEST_FILE).write_text(json.dumps({"step": step, "files": manifest}, indent=2))
        fsync_path(tmp / MANIFEST_FILE)
        fsync_path(tmp, directory=True)
        final = _free_name(run_dir, f"{CHECKPOINT_PREFIX}{step:06d}")
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(run_dir, directory=True)
    pointer = {"format": RUN_FORMAT, "checkpoint": final.name, "step": step, "made_by": made_by}
    try:
        atomic_write(run_dir / RUN_FILE, lambda t: Path(t).write_text(json.dumps(pointer)))
    except BaseException:
        if not _points_to(run_dir, final.name):  # never committed: the old one stays current
            shutil.rmtree(final, ignore_errors=True)
        raise
    _remove_stale(run_dir, keep=final.name)
    return final


def _points_to(run_dir: Path, name: str) -> bool:
    try:
        return read_pointer(run_dir)["checkpoint"] == name
    except (ValueError, OSError):
        return False


def _free_name(run_dir: Path, name: str) -> Path:
    candidate, n = run_dir / name, 1
    while candidate.exists():
        candidate, n = run_dir / f"{name}.{n}", n + 1
    return candidate


def _remove_stale(run_dir: Path, keep: str) -> None:
    """After a commit: older checkpoints, leftovers of interrupted saves (a killed save leaves
    its temporary folder or file), an older dikkat's flat files. Failing to remove them costs
    disk space, never the run, so errors are ignored."""
    for entry in run_dir.iterdir():
        stale_checkpoint = entry.name.startswith((CHECKPOINT_PREFIX, f".{CHECKPOINT_PREFIX}"))
        if stale_checkpoint and entry.name != keep and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX) and entry.is_file():
            with contextlib.suppress(OSError):
                entry.unlink()
    if (run_dir / LEGACY_RUN_FILE).is_file():
        for name in FLAT_FILES:
            (run_dir / name).unlink(missing_ok=True)


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The ``{file: {bytes, sha256}}`` of a checkpoint folder, or None if it has no manifest."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is unreadable or damaged: {e}") from None
    if not isinstance(files, dict):
        raise ValueError(f"{path} is damaged: 'files' is not a mapping")
    return files


def is_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` is a checkpoint of a run (``checkpoint-…`` beside a ``run.json``),
    which :func:`commit_checkpoint` always wrote with a manifest."""
    folder = Path(folder)
    return folder.name.startswith(CHECKPOINT_PREFIX) and (folder.parent / RUN_FILE).is_file()


def verify_checkpoint(folder: str | Path, names: tuple[str, ...] | None = None) -> bool:
    """Check the files of a checkpoint folder (all, or ``names``) against its manifest; raise
    ``ValueError`` naming the first damaged one. A run's checkpoint without its manifest is
    refused (``FileNotFoundError``) like a damaged one: nothing would show what else changed.
    False for a folder that never had one (a model saved with ``save()``, an older flat run)."""
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        if is_checkpoint(folder):
            raise FileNotFoundError(
                f"{folder / MANIFEST_FILE} is missing, so the checkpoint's files cannot be "
                "checked (pass verify=False / --no-verify to load it anyway)"
            )
        return False
    for name, expected in files.items():
        if names is None or name in names:
            verify(folder / name, expected)
    return True


def clear(path: str | Path, *, keep_model: bool = False) -> None:
    """Remove what dikkat wrote into ``path`` — a run's pointer, checkpoints, state, tokenizer,
    log and plot, and (unless ``keep_model``) a model's two files — and nothing else: the
    explicit ``overwrite`` of a folder."""
    path = Path(path)
    if not path.is_dir():
        return
    for entry in path.iterdir():
        if entry.is_dir() and entry.name.startswith((CHECKPOINT_PREFIX, f".{CHECKPOINT_PREFIX}")):
            shutil.rmtree(entry)
    model_files = ("config.json", "model.safetensors")
    for name in (RUN_FILE, *FLAT_FILES, *RUN_EXTRAS):
        if not (keep_model and name in model_files):
            (path / name).unlink(missing_ok=True)
