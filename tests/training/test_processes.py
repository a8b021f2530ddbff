"""Several processes and one run folder (docs/runs.md): real ``dikkat train`` processes.

- while one trainer holds a run, a second ``--resume`` (or ``--overwrite``) is refused in one line
  naming the holder's process id, and the holder's log stays one history; a trainer killed with
  SIGKILL leaves its lock stale, and the next one takes it;
- ``dikkat train --nproc 2``: the launcher holds the run for its ranks; SIGTERM to it reaches
  every rank and ends in one clean save; SIGKILL to it leaves no rank running.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dikkat import runs
from dikkat.training.trainer import LOG_FILE, resume_trainer

SRC = Path(__file__).resolve().parents[2] / "src"
LIMIT_S = 180  # a process (or a launch of 2) that takes longer has hung

# `dikkat train` with each step slowed down a little (the numbers are unchanged), so that the
# run is still going while the test acts on it
SLOW = """
import sys, time
import torch
torch.set_num_threads(1)
import dikkat.training.trainer as trainer
real = trainer.step_generator
def slow(seed, step):
    time.sleep(0.05)
    return real(seed, step)
trainer.step_generator = slow
from dikkat.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(Path(json.__file__).read_text() + Path(shutil.__file__).read_text())
    return path


def tiny(text: Path) -> list[str]:
    return [
        "--task", "lm", "--data", str(text), "--seq-len", "16", "--d-model", "16",
        "--layers", "1", "--heads", "2", "--dropout", "0", "--batch-size", "2",
        "--eval-every", "0", "--no-progress",
    ]  # fmt: skip


def env() -> dict[str, str]:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


class Process:
    """A started ``dikkat`` process; its stderr goes to a file, not a pipe, so that waiting
    for it never waits for processes it left behind that hold the pipe open."""

    def __init__(self, args: list[str], *, slow: bool = False) -> None:
        head = [sys.executable, "-c", SLOW] if slow else [sys.executable, "-m", "dikkat"]
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed when collected
        self.proc = subprocess.Popen(
            [*head, *args], env=env(), stdout=subprocess.DEVNULL, stderr=self.err, text=True
        )
        self.pid = self.proc.pid

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def finish(self, out: Path) -> tuple[int, str]:
        """The exit status and stderr, within LIMIT_S (failed after, the run's processes
        killed)."""
        try:
            self.proc.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            end_all(out)
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"a process ran past {LIMIT_S} s:\n{self.stderr()[-3000:]}")
        return self.proc.returncode, self.stderr()


def logged_steps(out: Path) -> list[int]:
    if not (out / LOG_FILE).is_file():
        return []
    lines = (out / LOG_FILE).read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if x.endswith("}") and '"loss"' in x]


def wait_for_step(out: Path, step: int, proc: Process) -> None:
    """Until ``proc`` has logged ``step`` (it is training, and holds the run)."""
    deadline = time.monotonic() + LIMIT_S
    while max(logged_steps(out), default=-1) < step:
        assert proc.proc.poll() is None, proc.stderr()[-3000:]
        assert time.monotonic() < deadline, f"step {step} was never logged"
        time.sleep(0.05)


def processes_of(out: Path) -> set[int]:
    """The processes whose command line names ``out``, this one's children or not."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # ended meanwhile
            if os.fsencode(out) in words and int(entry.name) != os.getpid():
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def end_all(out: Path) -> None:
    for pid in processes_of(out):  # the test's own processes: their command names its folder
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_a_run_is_trained_by_one_process_at_a_time(text, tmp_path):
    out = tmp_path / "run"
    args = ["train", *tiny(text), "--out", str(out)]
    try:
        assert Process([*args, "--steps", "2"]).finish(out)[0] == 0
        first = Process(["train", "--out", str(out), "--resume", "--steps", "99999"], slow=True)
        wait_for_step(out, 10, first)
        before = runs.read_pointer(out)
        second = Process(
            ["train", "--out", str(out), "--resume", "--steps", "400", "--no-progress"]
        )
        code, err = second.finish(out)
        assert code == 2
        assert one_line(err) == (
            f"dikkat: error: {out} is being trained by process {first.pid}: one trainer at a "
            "time writes a run (wait for it to end, or stop it)"
        )
        code, err = Process([*args, "--steps", "2", "--overwrite"]).finish(out)
        assert code == 2 and f"by process {first.pid}" in one_line(err)
        assert runs.read_pointer(out) == before  # neither wrote anything
        assert first.proc.poll() is None
        first.proc.send_signal(signal.SIGTERM)
        code, err = first.finish(out)
        assert code == 128 + signal.SIGTERM, err
        steps = logged_steps(out)  # every 10th step, and the 2nd (the first run's end)
        assert steps == [2, *range(10, steps[-1] + 1, 10)]  # one history, each step once
        stopped = runs.read_pointer(out)["step"]
        assert steps[-1] <= stopped < steps[-1] + 10  # saved after the step in flight

        # a holder that dies without a word (SIGKILL) leaves its pid in the lock file; the lock
        # itself died with it
        third = Process(["train", "--out", str(out), "--resume", "--steps", "99999"], slow=True)
        wait_for_step(out, stopped + 1, third)
        third.proc.kill()
        assert third.finish(out)[0] == -signal.SIGKILL
        assert (out / runs.LOCK_FILE).read_text().strip() == str(third.pid)
        resumed = resume_trainer(out)  # taken over, not refused
        resumed.train(progress=False, until=resumed.step + 1)
    finally:
        end_all(out)


def launcher_of(out: Path, text: Path, *args: str) -> Process:
    flags = [*tiny(text), "--out", str(out), "--save-every", "10", "--steps", "100000"]
    return Process(["train", "--nproc", "2", *flags, *args])


def ranks_of(out: Path, launcher: Process, step: int) -> set[int]:
    """The processes of ``launcher``'s run but itself, once it has logged ``step``."""
    wait_for_step(out, step, launcher)
    return processes_of(out) - {launcher.pid}


def wait_until_gone(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {p for p in pids if alive(p)}


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_signals_to_nproc_reach_every_rank(text, tmp_path):
    out = tmp_path / "run"
    try:
        launcher = launcher_of(out, text)
        ranks = ranks_of(out, launcher, 10)
        assert len(ranks) >= 2  # the two ranks (and, before, a torchrun between them and it)
        # the launcher holds the run for its ranks: a second trainer is refused, naming it
        code, err = Process(["train", "--out", str(out), "--resume", "--no-progress"]).finish(out)
        assert code == 2 and f"{out} is being trained by process {launcher.pid}:" in one_line(err)

        launcher.proc.send_signal(signal.SIGTERM)  # what `timeout`, Slurm and Kubernetes send
        code, err = launcher.finish(out)
        assert code == 128 + signal.SIGTERM, err
        assert wait_until_gone(ranks, 10) == set()
        said = [line for line in err.splitlines() if line.strip()]
        assert len(said) == 1 and "SIGTERM: stopped at step" in said[0], err  # rank 0 says it
        step = int(said[0].split("stopped at step ")[1].split(";")[0])
        assert runs.read_pointer(out)["step"] == step >= max(logged_steps(out))  # one save

        launcher = launcher_of(out, text, "--resume")
        ranks = ranks_of(out, launcher, step + 1)
        launcher.proc.kill()  # SIGKILL: nothing can be passed on; the ranks must not outlive it
        assert launcher.finish(out)[0] == -signal.SIGKILL
        assert wait_until_gone(ranks, 10) == set()
        resumed = resume_trainer(out)  # whole: the last checkpoint before the kill
        assert resumed.step == step or (resumed.step % 10 == 0 and resumed.step > step)
    finally:
        end_all(out)
