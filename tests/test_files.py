"""dikkat.files: a writer's own report of a full disk becomes the OSError it stands for, so
the command line ends in one line instead of a traceback, and the old file stays."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from dikkat.files import atomic_write, os_error_of


def test_safetensors_names_its_os_error():
    error = SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    found = os_error_of(error, "/x/model.safetensors")
    assert isinstance(found, OSError) and found.errno == errno.ENOSPC


def test_an_unexplained_writer_error_is_a_full_disk_only_when_the_disk_is_full(monkeypatch):
    error = RuntimeError("[enforce fail at inline_container.cc] unexpected pos 704 vs 598")
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=0))
    assert os_error_of(error, "/x/state.pt").errno == errno.ENOSPC
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=10))
    assert os_error_of(error, "/x/state.pt") is None  # another bug: its own traceback


def test_atomic_write_turns_it_into_an_oserror_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2)}, target)
    before = target.read_bytes()

    def full(tmp: str) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left (os error 28)")

    with pytest.raises(OSError) as caught:
        atomic_write(target, full)
    assert caught.value.errno == errno.ENOSPC
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary left

    def bug(tmp: str) -> None:
        raise ValueError("not a disk")

    with pytest.raises(ValueError, match="not a disk"):
        atomic_write(target, bug)


def test_a_real_full_disk(tmp_path):
    """safetensors and torch.save on a 64 KiB tmpfs (as root, where mounting is allowed)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mount is not allowed here")
    try:
        big = {"a": torch.zeros(100_000)}
        for write in (lambda tmp: save_file(big, tmp), lambda tmp: torch.save(big, tmp)):
            with pytest.raises(OSError) as caught:
                atomic_write(mnt / "f", write)
            assert caught.value.errno == errno.ENOSPC
            assert list(mnt.iterdir()) == []
    finally:
        gc.collect()  # a failed torch.save can hold its file open until collected
        subprocess.run(["umount", "--lazy", str(mnt)], check=False)


_SAVE_UNDER_LIMIT = """
import errno, resource, sys, torch
from pathlib import Path
from dikkat.files import atomic_write
target = Path(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    atomic_write(target, lambda tmp: torch.save({"a": torch.zeros(100_000)}, tmp))
except OSError as e:
    print(e.errno == errno.EFBIG, e)
"""


def test_a_save_past_the_file_size_limit_names_the_limit(tmp_path):
    """torch.save's zip writer reports a write refused by ``ulimit -f`` as "unexpected pos";
    the error names the limit instead (a child process: the limit is the process's)."""
    target = tmp_path / "state.pt"
    target.write_bytes(b"the previous checkpoint")
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_UNDER_LIMIT, str(target)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, _, message = done.stdout.strip().partition(" ")
    assert first == "True", done.stdout
    assert "ulimit -f" in message and "65536 bytes" in message, message
    assert target.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temporary left
