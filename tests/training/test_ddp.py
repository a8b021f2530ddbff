"""Data-parallel training (docs/distributed-training.md): 2 processes on the CPU (gloo, loopback),
started by PyTorch's launcher, against 1 process with the same whole-step batch.

- the losses of every step and the weights reached equal one process's, to fp32 rounding;
- rank 0 alone writes the run folder (Python's audit hooks record each rank's writes);
- a rank killed with SIGKILL stops the run, and the last checkpoint resumes in 1 process with the
  next-step loss of uninterrupted training;
- ``dikkat train --nproc 2`` trains the same run and resumes with --nproc 1 and 2;
- a rank of ``dikkat train`` frees its DDP wrapper before it leaves the process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dikkat import runs
from dikkat.cli import main
from dikkat.cli.launch import free_port
from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import LOG_FILE, TrainConfig, Trainer, resume_trainer

WORKER = Path(__file__).with_name("ddp_worker.py")
CLI_RANK = Path(__file__).with_name("cli_rank.py")
SRC = Path(__file__).resolve().parents[2] / "src"
LIMIT_S = 120  # a launch that takes longer has hung


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(Path(json.__file__).read_text() + Path(shutil.__file__).read_text())
    return path


def spec_of(text: Path) -> TaskSpec:
    overrides = {"d_model": 16, "n_layers": 1, "n_heads": 2, "dropout": 0.0}
    return TaskSpec(task="lm", seq_len=16, data=str(text), model_overrides=overrides)


def env() -> dict[str, str]:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def launcher(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *args,
    ]


def start_workers(
    spec: TaskSpec, config: TrainConfig, out: Path, side: Path, **options: object
) -> subprocess.Popen:
    """2 ranks of ddp_worker.py; ``options``: its OPTIONS (``parallel``, ``until``)."""
    side.mkdir(exist_ok=True)
    args = [json.dumps(asdict(spec)), json.dumps(asdict(config)), str(out), str(side)]
    args.append(json.dumps(options))
    command = launcher(2, str(WORKER), *args)
    return subprocess.Popen(command, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the launcher ran past {LIMIT_S} s:\n{output.decode()[-3000:]}")
    return proc.returncode, output.decode()


def losses(history: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history if "loss" in r}


def log_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]


def single(spec: TaskSpec, config: TrainConfig, out: Path | None, until: int | None) -> Trainer:
    trainer = Trainer(build_task(spec), config, out)
    trainer.train(progress=False, until=until)
    return trainer


def test_two_ranks_train_as_one_process_and_only_rank_0_writes(text, tmp_path):
    spec = spec_of(text)
    config = TrainConfig(steps=4, batch_size=4, warmup=2, eval_every=0, log_every=1)
    out, side = tmp_path / "ddp", tmp_path / "side"
    code, output = finish(start_workers(spec, config, out, side))
    assert code == 0, output[-3000:]

    reference = single(spec, config, tmp_path / "one", None)
    two, one = log_of(out), reference.history
    assert sorted(losses(two)) == [1, 2, 3, 4]  # every step once: no rank logged twice
    for step, loss in losses(one).items():
        assert losses(two)[step] == pytest.approx(loss, rel=1e-6, abs=1e-6)
    assert len({r["loss"] for r in two if "loss" in r}) == 4  # the model did change
    val = [r["val_loss"] for r in two if "val_loss" in r]
    assert val == pytest.approx([r["val_loss"] for r in one if "val_loss" in r], rel=1e-6)
    folder = runs.checkpoint_dir(out)
    assert folder.name == "checkpoint-000004" and runs.verify_checkpoint(folder)
    theirs = load_file(folder / "model.safetensors")
    ours = {k: v for k, v in reference.model.state_dict().items() if k in theirs}
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        torch.testing.assert_close(t, ours[name], rtol=1e-5, atol=1e-6, msg=name)

    rank0 = json.loads((side / "writes-0.json").read_text())
    rank1 = json.loads((side / "writes-1.json").read_text())
    assert any("log.jsonl" in w for w in rank0) and any("run.json" in w for w in rank0)
    assert rank1 == []
    names = {p.name for p in out.iterdir()}
    assert names == {"run.json", "checkpoint-000004", LOG_FILE, "loss.png", runs.LOCK_FILE}


def test_a_killed_rank_stops_the_run_and_it_resumes_in_one_process(text, tmp_path):
    spec = spec_of(text)
    # many steps: the run is still going when a rank is killed after the first checkpoint
    config = TrainConfig(
        steps=5000, batch_size=4, warmup=2, eval_every=0, log_every=1, save_every=2
    )
    out, side = tmp_path / "ddp", tmp_path / "side"
    proc = start_workers(spec, config, out, side)
    deadline = time.monotonic() + LIMIT_S
    while not (out / runs.RUN_FILE).exists() or not (side / "pid-1").exists():
        assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    os.kill(int((side / "pid-1").read_text()), signal.SIGKILL)
    code, output = finish(proc)
    assert code != 0, output[-3000:]  # the launcher saw a rank die and stopped the other

    trainer = resume_trainer(out)  # one process now
    done = trainer.step
    assert done >= 2 and done % 2 == 0 and done < config.steps
    trainer.train(progress=False, until=done + 1)
    reference = single(spec, config, None, done + 1)
    resumed, uninterrupted = losses(trainer.history), losses(reference.history)
    assert sorted(resumed) == list(range(1, done + 2))  # the log was cut back to the checkpoint
    for step in range(1, done + 2):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5, abs=1e-6), step


def test_nproc_launches_the_run_and_resume_works_with_any_nproc(
    text, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    flags = [
        "--data", str(text), "--seq-len", "16", "--d-model", "16", "--layers", "1",
        "--heads", "2", "--dropout", "0", "--batch-size", "4", "--warmup", "2",
        "--eval-every", "0", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", env()["PYTHONPATH"])  # the ranks import this dikkat
    assert main(["train", "--nproc", "2", "--steps", "4", *flags]) == 0
    assert runs.checkpoint_dir(out).name == "checkpoint-000004"
    config = TrainConfig(steps=4, batch_size=4, warmup=2, eval_every=0)
    reference = single(spec_of(text), config, None, None)
    assert losses(log_of(out))[4] == pytest.approx(losses(reference.history)[4], rel=1e-6)
    assert main(["train", "--resume", "--steps", "6", *flags]) == 0  # 1 process
    assert main(["train", "--nproc", "2", "--resume", "--steps", "8", *flags]) == 0
    assert runs.checkpoint_dir(out).name == "checkpoint-000008"
    assert sorted(losses(log_of(out))) == [4, 6, 8]
    assert main(["train", "--nproc", "3", "--steps", "4", *flags[:-1], str(tmp_path / "x")]) == 2
    assert "not a multiple of --nproc 3" in capsys.readouterr().err


def test_a_rank_frees_its_ddp_wrapper_before_it_leaves_the_group(text, tmp_path):
    """Freed after the group, the wrapper's reducer destroys the group with the GIL held, which
    can hang the rank at its end (dikkat.training.parallel.release)."""
    flags = [
        "--data", str(text), "--seq-len", "16", "--d-model", "16", "--layers", "1",
        "--heads", "2", "--dropout", "0", "--batch-size", "4", "--steps", "2",
        "--eval-every", "0", "--no-progress", "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    command = launcher(2, str(CLI_RANK), "train", *flags)
    proc = subprocess.Popen(command, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    code, output = finish(proc)
    assert code == 0, output[-3000:]
    assert output.count("DDP objects alive at release: 0") == 2, output[-3000:]
