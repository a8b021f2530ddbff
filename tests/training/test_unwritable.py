"""Run folders that cannot be written end in one line, never a traceback — and before training
where that can be known: a ``log.jsonl`` that is a folder, a read-only file system at
``--resume``, a disk that fills during a save (the run then resumes from the checkpoint before).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import dikkat.models.io as model_io
from dikkat import runs
from dikkat.training.trainer import LOG_FILE, resume_trainer
from helpers import run_cli, shared_text

TEXT = shared_text("dikkat-test-unwritable-corpus.txt", Path(json.__file__).read_text() * 3)
TINY = [
    "--task", "lm", "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "16",
    "--data", str(TEXT), "--batch-size", "2", "--eval-every", "0", "--no-progress",
]  # fmt: skip


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def one_line(code: int, err: str, status: int = 2) -> str:
    assert code == status, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip().removeprefix("dikkat: error: ")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run of 3 steps, to copy."""
    out = tmp_path_factory.mktemp("unwritable") / "run"
    from dikkat.cli import main

    assert main(["train", "--steps", "3", "--out", str(out), *TINY]) == 0
    runs.release(out)  # this process wrote it; the tests' own commands take it again
    return out


def test_a_log_that_is_a_folder_is_refused_before_training(run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / LOG_FILE).unlink()
    (out / LOG_FILE).mkdir()
    before = snapshot(out)
    message = f"{out / LOG_FILE} is a folder: the run writes its log.jsonl there (move it away)"
    code, text, err = run_cli(["train", "--out", str(out), "--resume", "--steps", "5"], capsys)
    assert one_line(code, err) == message and "resuming" not in text
    argv = ["train", "--steps", "2", "--out", str(out), "--overwrite", *TINY]
    code, text, err = run_cli(argv, capsys)
    assert one_line(code, err) == message and "parameters" not in text  # before building
    assert snapshot(out) == before and (out / LOG_FILE).is_dir()


def test_a_read_only_run_is_found_before_resuming(run, tmp_path, capsys, monkeypatch):
    """The file system refuses every new file in the run folder (EROFS, as a read-only mount
    does — also as root, where permissions would not stop a write)."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    before = snapshot(out)
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        if writing and str(path).startswith(str(out)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code, text, err = run_cli(["train", "--out", str(out), "--resume", "--steps", "6"], capsys)
    assert one_line(code, err) == f"out_dir {out} is not writable: Read-only file system"
    assert "resuming" not in text  # refused before the trainer was handed back, let alone ran
    monkeypatch.undo()
    assert snapshot(out) == before


def test_a_read_only_mount_is_found_before_resuming(run, tmp_path, capsys):
    """The same on a real read-only file system, where this machine lets the test make one
    (as root: a tmpfs mounted read-only; otherwise: a folder without write permission)."""
    if os.geteuid() == 0:
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)])
        if r.returncode != 0:
            pytest.skip("as root, a read-only folder needs a mount, not allowed here")
        out = mnt / "run"
        shutil.copytree(run, out)
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)]).returncode == 0
    else:
        out = tmp_path / "run"
        shutil.copytree(run, out)
        for p in (out, *[p for p in out.rglob("*") if p.is_dir()]):
            p.chmod(0o555)
    try:
        code, text, err = run_cli(["train", "--out", str(out), "--resume", "--steps", "6"], capsys)
        assert one_line(code, err).startswith(f"out_dir {out} is not writable"), err
        assert "resuming" not in text
        assert runs.read_pointer(out)["step"] == 3
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(tmp_path / "mnt")], check=False)
        else:
            for p in (out, *[p for p in out.rglob("*") if p.is_dir()]):
                p.chmod(0o755)


def test_a_disk_that_fills_during_a_save_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """The checkpoint at step 2 is written; the one at step 3 finds the disk full."""
    out = tmp_path / "run"
    real, calls = model_io.save_file, []

    def fills_up(tensors, path, *args, **kwargs):
        calls.append(path)
        real(tensors, path, *args, **kwargs)
        if len(calls) == 2:  # half of the second checkpoint's weights, then no space
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(model_io, "save_file", fills_up)
    argv = ["train", "--steps", "3", "--save-every", "2", "--out", str(out), *TINY]
    code, _, err = run_cli(argv, capsys)
    assert one_line(code, err, status=1) == (
        f"could not write the checkpoint of step 3 in {out}: No space left on device; the last "
        "checkpoint (step 2) is whole and current: --resume continues from it once the cause "
        "is fixed"
    )
    monkeypatch.undo()
    runs.release(out)
    assert len(calls) == 2 and resume_trainer(out, steps=3).step == 2
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [runs.LOCK_FILE]


def test_a_full_disk_as_torch_save_reports_it_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """torch.save reports a full disk as a RuntimeError of its zip writer, not an OSError: with
    no free block on the disk it is taken for what it is."""
    import types

    import dikkat.training.checkpoint as checkpoint

    out = tmp_path / "run"
    real, calls = checkpoint.torch.save, []

    def zip_writer_fails(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            monkeypatch.setattr(os, "statvfs", lambda p: types.SimpleNamespace(f_bavail=0))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", zip_writer_fails)
    argv = ["train", "--steps", "3", "--save-every", "2", "--out", str(out), *TINY]
    code, _, err = run_cli(argv, capsys)
    assert one_line(code, err, status=1).startswith(
        f"could not write the checkpoint of step 3 in {out}: No space left on device; the last "
        "checkpoint (step 2) is whole and current"
    )
    monkeypatch.undo()
    runs.release(out)
    assert resume_trainer(out, steps=3).step == 2
