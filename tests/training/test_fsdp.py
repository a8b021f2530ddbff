"""Sharded training, ``parallel="fsdp"`` / ``--fsdp`` (docs/distributed-training.md): 2 processes
on the CPU (gloo, loopback) against 1 process with the same whole-step batch.

- the losses of every step, the validation losses, the task's metrics and the weights saved
  equal one process's, to fp32 rounding, for ``lm`` (a GPT, tied embeddings) and ``mlm`` (a
  BERT encoder);
- the checkpoint is the run folder one process writes (``GPT.load`` reads it; the same names);
- a run of 2 sharded processes resumes in 1, and a run of 1 resumes sharded in 2 (through
  ``dikkat train --nproc 2 --fsdp --resume``), with the losses of one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_ddp import env, finish, log_of, losses, single, spec_of, start_workers, text

from dikkat import runs
from dikkat.cli import main
from dikkat.models.gpt import GPT
from dikkat.tasks import build_task
from dikkat.training.trainer import TrainConfig, Trainer, resume_trainer

__all__ = ["text"]  # the corpus fixture, shared with test_ddp.py
WEIGHTS = "model.safetensors"


def assert_same_run(two: list[dict], one: list[dict]) -> None:
    """Every logged figure of the 2-process run (losses, validation losses, metrics) equals the
    1-process run's, step by step."""
    assert [sorted(r) for r in two] == [sorted(r) for r in one]  # the same records, in order
    for theirs, ours in zip(two, one, strict=True):
        for key, value in ours.items():
            if key not in ("lr", "tokens_per_s", "step"):
                assert theirs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, ours)
            elif key == "step":
                assert theirs[key] == value


def assert_same_weights(folder: Path, reference: Path) -> None:
    """The model.safetensors of the two folders hold the same tensors under the same names."""
    theirs, ours = load_file(folder / WEIGHTS), load_file(reference / WEIGHTS)
    assert theirs.keys() == ours.keys()
    for name, t in theirs.items():
        torch.testing.assert_close(t, ours[name], rtol=1e-5, atol=1e-6, msg=name)


def test_two_sharded_lm_ranks_train_as_one_process_and_resume_in_one(text, tmp_path):
    spec = spec_of(text)
    config = TrainConfig(steps=6, batch_size=4, warmup=2, eval_every=2, log_every=1, save_every=3)
    out, side = tmp_path / "fsdp", tmp_path / "side"
    code, output = finish(start_workers(spec, config, out, side, parallel="fsdp", until=4))
    assert code == 0, output[-3000:]

    reference = single(spec, config, None, 4)
    assert_same_run(log_of(out), reference.history)
    assert len(losses(reference.history)) == 4 and len(set(losses(log_of(out)).values())) == 4
    folder = runs.checkpoint_dir(out)
    assert folder.name == "checkpoint-000004" and runs.verify_checkpoint(folder)
    reference.model.save(tmp_path / "one-4")
    assert_same_weights(folder, tmp_path / "one-4")
    assert isinstance(GPT.load(out), GPT)
    assert (side / "writes-1.json").read_text() == "[]"  # rank 1 wrote nothing

    trainer = resume_trainer(out)  # one process now
    assert trainer.step == 4
    trainer.train(progress=False)
    reference.train(progress=False)
    assert_same_run(log_of(out), reference.history)
    reference.model.save(tmp_path / "one-6")
    assert_same_weights(runs.checkpoint_dir(out), tmp_path / "one-6")


def test_fsdp_resumes_a_one_process_mlm_run_in_two_sharded_processes(text, tmp_path, monkeypatch):
    def flags(out: Path) -> list[str]:
        return [
            "--task", "mlm", "--data", str(text), "--seq-len", "16", "--d-model", "16",
            "--layers", "1", "--heads", "2", "--dropout", "0", "--batch-size", "4",
            "--warmup", "2", "--eval-every", "2", "--no-progress", "--out", str(out),
        ]  # fmt: skip

    sharded, one = tmp_path / "sharded", tmp_path / "one"
    monkeypatch.setenv("PYTHONPATH", env()["PYTHONPATH"])  # the ranks import this dikkat
    # with one process --fsdp has nothing to shard: the run is the one of one process
    assert main(["train", "--fsdp", "--steps", "4", *flags(sharded)]) == 0
    resumed = ["--nproc", "2", "--fsdp", "--resume", "--steps", "6"]
    assert main(["train", *resumed, *flags(sharded)]) == 0
    assert main(["train", "--steps", "4", *flags(one)]) == 0
    assert main(["train", "--resume", "--steps", "6", *flags(one)]) == 0

    two, reference = log_of(sharded), log_of(one)
    assert sorted(losses(two)) == [4, 6]  # the means of steps 1–4 and 5–6
    assert any("masked_accuracy" in r for r in reference)  # the task's metrics are compared too
    assert_same_run(two, reference)
    folder = runs.checkpoint_dir(sharded)
    assert folder.name == "checkpoint-000006" and runs.verify_checkpoint(folder)
    assert_same_weights(folder, runs.checkpoint_dir(one))


def test_an_unknown_parallel_is_refused(text):
    task, config = build_task(spec_of(text)), TrainConfig(steps=1, batch_size=2)
    with pytest.raises(ValueError, match="parallel must be 'ddp' or 'fsdp', got 'zero'"):
        Trainer(task, config, parallel="zero")
