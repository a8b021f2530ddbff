"""Faults while a run saves: every write fails in turn, the process dies at every write, the disk
fills up, signals arrive mid-run — and afterwards the run always resumes from a whole checkpoint.

A run is saved at step 4, trained to step 6 in memory, and its second save is broken at its k-th
file-system operation, for every k, in two ways:

- *fail*: the operation raises ``OSError(ENOSPC)`` (or writes half a file, then raises) and the
  save's own clean-up runs — afterwards the step-4 checkpoint is current and nothing is left over;
- *kill*: the process "dies" there — a ``BaseException`` with every clean-up disabled, as after
  SIGKILL or a power cut — afterwards the run resumes at step 4 or, if the pointer had already
  been switched, at step 6, and its weights are exactly that step's.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import dikkat.models.io as model_io
from dikkat import runs
from dikkat.files import sha256
from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import LOG_FILE, PLOT_FILE, TrainConfig, Trainer, resume_trainer
from helpers import shared_text

# a small text of this Python's own (read once; the standard library's full walk is slow)
TEXT = shared_text(
    "dikkat-test-faults-corpus.txt",
    Path(json.__file__).read_text() + Path(shutil.__file__).read_text(),
)
SPEC = TaskSpec(
    task="lm",
    seq_len=16,
    data=str(TEXT),
    model_overrides={"d_model": 16, "n_layers": 1, "n_heads": 2, "dropout": 0.1, "max_len": 16},
)
CONFIG = TrainConfig(steps=8, batch_size=2, warmup=2, eval_every=0, log_every=1, eval_batches=1)
FIRST, SECOND = 4, 6  # the saved checkpoint, and the step whose save is broken


@pytest.fixture(scope="module")
def task():
    return build_task(SPEC)


def trainer_at(task, out: Path, step: int) -> Trainer:
    torch.manual_seed(SPEC.seed)
    task.model = type(task.model)(task.model.config)
    t = Trainer(task, CONFIG, out)
    t.train(progress=False, until=step)
    return t


def weights_of(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.model.state_dict().items()}


class Killed(BaseException):
    """The process died here: nothing after this line of the save runs, no clean-up either."""


# the file-system operations a save performs, by (module or class, attribute)
OPERATIONS: list[tuple[object, str]] = [
    (model_io, "save_file"),  # the weights
    (torch, "save"),  # the trainer state
    (pathlib.Path, "write_text"),  # task.json, manifest.json, run.json, tokenizer config
    (os, "open"),  # temporary files (mkstemp) and fsync's descriptors
    (os, "mkdir"),  # the checkpoint's temporary folder (mkdtemp)
    (os, "chmod"),
    (os, "fsync"),
    (os, "rename"),  # the checkpoint folder to its final name
    (os, "replace"),  # a temporary file onto its name: the pointer switch is one of these
]
WRITERS = {"save_file", "save", "write_text"}  # these leave half a file when they fail
CLEAN_UPS: list[tuple[object, str]] = [(shutil, "rmtree"), (pathlib.Path, "unlink")]


@contextmanager
def broken_at(k: int, mode: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Break the k-th operation (1-based); yields the names of the operations seen."""
    seen: list[str] = []

    def wrap(owner: object, name: str, real: Callable) -> Callable:
        def op(*args, **kwargs):
            seen.append(name + ("(folder)" if _on_a_folder(name, args) else ""))
            if len(seen) != k:
                return real(*args, **kwargs)
            if name in WRITERS:  # half a file, as a full disk leaves it
                real(*args, **kwargs)
                target = args[1] if name in ("save_file", "save") else args[0]
                if isinstance(target, (str, os.PathLike)) and os.path.isfile(target):
                    with open(target, "r+b") as f:
                        f.truncate(os.path.getsize(target) // 2)
            if mode == "kill":
                for owner_, attr in CLEAN_UPS:
                    monkeypatch.setattr(owner_, attr, lambda *a, **kw: None)
                raise Killed
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        return op

    for owner, name in OPERATIONS:
        monkeypatch.setattr(owner, name, wrap(owner, name, getattr(owner, name)))
    try:
        yield seen
    finally:
        monkeypatch.undo()


def _on_a_folder(name: str, args: tuple) -> bool:
    import stat

    if name == "fsync":
        return stat.S_ISDIR(os.fstat(args[0]).st_mode)
    if name in ("open", "mkdir"):  # mkdir of a folder that exists is a no-op
        return os.path.isdir(args[0])
    return False


def operations_of_one_save(task, tmp_path: Path) -> int:
    """The file-system operations of training on from FIRST to SECOND: the save at SECOND's."""
    t = trainer_at(task, tmp_path / "count", FIRST)
    with broken_at(10**9, "fail", pytest.MonkeyPatch()) as seen:
        t.train(progress=False, until=SECOND)
    return len(seen)


@pytest.mark.parametrize("mode", ["fail", "kill"])
def test_every_operation_of_a_save_broken_in_turn(task, tmp_path, mode, monkeypatch):
    n = operations_of_one_save(task, tmp_path)
    assert n >= 15, n  # the weights, state, task, tokenizer, manifest, pointer and their syncs
    survived = []
    for k in range(1, n + 1):
        out = tmp_path / f"{mode}-{k}"
        t = trainer_at(task, out, FIRST)
        at_first = weights_of(t)
        with broken_at(k, mode, monkeypatch) as seen:
            try:  # the steps touch no file but the log; the save at SECOND is broken
                t.train(progress=False, until=SECOND)
                survived.append(seen[k - 1])
            except (OSError, Killed):
                pass
        assert t.step == SECOND
        at_second = weights_of(t)  # what the broken save was writing
        assert len(seen) >= k
        resumed = resume_trainer(out)  # every file checked against its SHA-256 first
        expected = {FIRST: at_first, SECOND: at_second}
        assert resumed.step in expected, (k, seen[k - 1], resumed.step)
        if mode == "fail" and resumed.step == FIRST:  # the save cleaned up after itself
            names = sorted(p.name for p in out.iterdir())
            want = [runs.LOCK_FILE, f"checkpoint-{FIRST:06d}", LOG_FILE, PLOT_FILE, runs.RUN_FILE]
            assert names == want, (k, names)
        for name, value in resumed.model.state_dict().items():
            assert torch.equal(value, expected[resumed.step][name]), (k, seen[k - 1], name)
        resumed.train(progress=False, until=SECOND + 1)  # goes on, saving over any leftovers
        left = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
        assert left == [runs.LOCK_FILE], (k, left)  # the lock file stays, and nothing else
    # only a failed flush of a folder passes without an error (the files are whole and in
    # place; some filesystems cannot flush a folder at all)
    assert all(op.endswith("(folder)") for op in survived), survived


def test_a_full_disk_keeps_the_previous_checkpoint(task, tmp_path):
    """A real small filesystem (tmpfs, where this machine lets us mount one) fills up during a
    save; the run resumes from the checkpoint before, and saves again once space is freed."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("needs root and mount(8) to create a small tmpfs")
    mnt = Path(tempfile.mkdtemp(prefix="dikkat-tmpfs-"))
    t = trainer_at(task, tmp_path / "probe", FIRST)
    one = sum(p.stat().st_size for p in runs.checkpoint_dir(tmp_path / "probe").iterdir())
    plot = -(-(tmp_path / "probe" / PLOT_FILE).stat().st_size // 4096) * 4096  # in pages
    size = one * 3 // 2 + plot  # one checkpoint (and its loss.png) fits, two do not
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)])
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        out = mnt / "run"
        t = trainer_at(task, out, FIRST)
        before = weights_of(t)
        with pytest.raises(OSError) as e:  # the checkpoint at SECOND does not fit beside FIRST's
            t.train(progress=False, until=SECOND)
        assert e.value.errno == errno.ENOSPC
        left = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
        assert left == [runs.LOCK_FILE]
        resumed = resume_trainer(out)
        assert resumed.step == FIRST
        for name, value in resumed.model.state_dict().items():
            assert torch.equal(value, before[name]), name
        # the cause fixed (the filesystem grown), the same trainer saves again
        grow = ["mount", "-o", f"remount,size={one * 3 + 2 * plot}", str(mnt)]
        assert subprocess.run(grow).returncode == 0
        t.save()
        assert resume_trainer(out).step == SECOND
    finally:
        runs.release(mnt / "run")  # the lock file is open while a trainer holds the run
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def test_files_follow_the_umask(task, tmp_path):
    old = os.umask(0o027)
    try:
        t = trainer_at(task, tmp_path / "run", FIRST)
        t.plot()
    finally:
        os.umask(old)
    for p in (tmp_path / "run").rglob("*"):
        mode = p.stat().st_mode & 0o777
        assert mode == (0o750 if p.is_dir() else 0o640), (p, oct(mode))


# --- signals, in a real process -------------------------------------------------------------

# Runs `dikkat train` with each step slowed down a little (the numbers are unchanged) and the
# step about to run written to a file, so that a signal can be sent in the middle of the run.
DRIVER = """
import os, sys, time
import torch
torch.set_num_threads(1)
import dikkat.training.trainer as trainer
real, where = trainer.step_generator, os.environ["STEP_FILE"]
def slow(seed, step):
    with open(where, "w") as f:
        f.write(str(step))
    time.sleep(0.02)
    return real(seed, step)
trainer.step_generator = slow
from dikkat.cli import main
sys.exit(main(sys.argv[1:]))
"""
TRAIN = [
    "train", "--task", "lm", "--steps", "40", "--save-every", "5", "--d-model", "16",
    "--layers", "1", "--heads", "2", "--seq-len", "16", "--data", str(TEXT),
    "--batch-size", "2", "--eval-every", "0", "--dropout", "0.1", "--no-progress",
]  # fmt: skip


def run_driver(args: list[str], step_file: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEP_FILE": str(step_file)}
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def log_of(out: Path) -> list[dict]:
    """The log's lines without the throughput, which depends on the machine's load."""
    rows = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def final_weights(out: Path) -> str:
    return sha256(runs.checkpoint_dir(out) / "model.safetensors")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    p = run_driver([*TRAIN, "--out", str(d / "run")], d / "step")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    return log_of(d / "run"), final_weights(d / "run")


@pytest.mark.parametrize(
    "sig, at_step", [(signal.SIGINT, 13), (signal.SIGTERM, 21), (signal.SIGKILL, 17)]
)
def test_a_signal_mid_run_then_resume_equals_an_uninterrupted_run(
    straight_run, tmp_path, sig, at_step
):
    out, step_file = tmp_path / "run", tmp_path / "step"
    p = run_driver([*TRAIN, "--out", str(out)], step_file)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if step_file.exists() and step_file.read_text() == str(at_step):
            break
        time.sleep(0.002)
    assert p.poll() is None, "the run ended before the signal"
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    if sig == signal.SIGKILL:
        assert p.returncode == -signal.SIGKILL
        assert runs.read_pointer(out)["step"] == (at_step // 5) * 5  # the last checkpoint
    else:  # saved after the step in flight; a one-line message, no traceback
        assert p.returncode == 128 + sig, err
        assert "saved in" in err and "Traceback" not in err, err
        assert runs.read_pointer(out)["step"] == at_step + 1
    r = run_driver(["train", "--out", str(out), "--resume", "--no-progress"], step_file)
    _, err = r.communicate(timeout=300)
    assert r.returncode == 0, err
    want_log, want_weights = straight_run
    assert log_of(out) == want_log  # bit for bit, every logged mean and the validation loss
    assert final_weights(out) == want_weights
