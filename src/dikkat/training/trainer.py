"""One plain training loop: AdamW, warmup + cosine, clipping, optional bf16, eval, checkpoints.

A run lives in one folder (:mod:`dikkat.runs`): ``run.json`` points at the current checkpoint
folder (model, tokenizer, ``task.json``, ``trainer_state.pt`` and their manifest, see
:mod:`dikkat.training.checkpoint`), beside ``log.jsonl`` (one JSON line per logged step and
evaluation) and ``loss.png``. A save writes a whole new checkpoint and then switches the pointer,
so a kill, a full disk or any failed write leaves the previous checkpoint whole and resumable;
a resume checks every file against its SHA-256 first.

Ctrl-C and SIGTERM let the step in flight finish, then save. A loss or gradient that is not
finite stops the run *before* the step is applied, keeping the last good checkpoint. The batch of
step s is drawn from a generator seeded by (seed, s), so resuming draws exactly the batches an
uninterrupted run would have.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from dikkat.files import atomic_write
from dikkat.layers.inputs import check_device
from dikkat.runs import RunLock
from dikkat.tasks import Task, TaskSpec, build_task, step_generator
from dikkat.text import load_tokenizer
from dikkat.training.checkpoint import (
    LOG_FILE,
    PLOT_FILE,
    STATE_FILE,
    TASK_FILE,
    append_log,
    check_out_dir,
    hold_out_dir,
    prepare_out_dir,
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
    write_log,
)
from dikkat.training.config import TrainConfig, extended, lr_factor, make_optimizer
from dikkat.training.parallel import (
    agree_signal,
    barrier,
    detect_ranks,
    rank_device,
    reduce_step,
    seed_step,
    sum_over_ranks,
)
from dikkat.training.results import DivergedError, TrainResult
from dikkat.training.signals import TrainingInterrupted, finish_step_on_signals
from dikkat.training.strategy import strategy
from dikkat.viz.curves import plot_losses

__all__ = [
    "LOG_FILE",
    "PLOT_FILE",
    "STATE_FILE",
    "TASK_FILE",
    "DivergedError",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingInterrupted",
    "lr_factor",
    "make_optimizer",
    "resume_trainer",
    "train",
]


class Trainer:
    """Trains ``task.model`` on ``task`` with ``config``, saving into ``out_dir`` (optional).

    ``out_dir`` must be new or empty: a folder holding a run, a model or other files is refused
    (``ValueError``) unless ``overwrite=True``, which removes what dikkat wrote there when
    training starts. ``made_by`` is recorded in the run's ``run.json``. ``device`` is where the
    model trains (the task's batches are moved there); it is not part of the run, so a run
    trained on one device resumes on another. From its first write it holds the run's lock
    (:func:`dikkat.runs.hold`); a write that fails (a full disk) raises ``SaveError``.

    Under ``torchrun`` (or in an initialised process group) it trains data-parallel
    (:mod:`dikkat.training.parallel`): ``config.batch_size`` is then the batch of a whole step,
    split between the ranks, and rank 0 alone writes ``out_dir`` and shows progress.
    ``parallel`` is how the ranks hold the model (:mod:`dikkat.training.strategy`): ``"ddp"``
    whole on each, ``"fsdp"`` sharded; like ``device`` it is not part of the run.
    """

    def __init__(
        self,
        task: Task,
        config: TrainConfig,
        out_dir: str | Path | None = None,
        *,
        overwrite: bool = False,
        made_by: str = "dikkat.Trainer",
        device: str | torch.device = "cpu",
        parallel: str = "ddp",
        _resuming: bool = False,
    ) -> None:
        self.task, self.config = task, config
        device = check_device("device", device)
        self.ranks = detect_ranks(device)
        self.ranks.rows(config.batch_size)  # a batch the ranks cannot share is refused now
        self.device = rank_device(device, self.ranks)
        self.model = self.place(task.model)
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.made_by = made_by
        self._overwrite = overwrite
        if self.out_dir is not None and not _resuming:  # every rank, before the first collective
            check_out_dir(self.out_dir, overwrite=overwrite)
        self._needs_prepare = self.out_dir is not None and not _resuming and self.ranks.main
        self._lock: RunLock | None = None  # rank 0's hold on out_dir, from its first write
        self.parallel = strategy(parallel, self.ranks)
        self._step_loss = self.parallel.wrap(task, self.model, self.ranks, self.device)  # (loss, n)
        self.optimizer = make_optimizer(self.model, config)  # on the shards, under fsdp
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config)
        )
        self.step = 0
        self.saved_step: int | None = None  # the step of the run's current checkpoint on disk
        self.history: list[dict[str, Any]] = []
        # losses of the steps since the last log line: saved with the run, so that a resumed
        # run logs the same means as an uninterrupted one
        self._window: list[float] = []
        self._interrupted: int | None = None  # the signal that asked the loop to stop

    def place(self, model: nn.Module) -> nn.Module:
        """The model on the trainer's device (a subclass whose model cannot move says so)."""
        return model.to(self.device)

    # --- checkpoints ----------------------------------------------------------------------------

    def _prepare(self) -> None:
        """Before the first write (rank 0): hold ``out_dir`` (created, checked, locked), and
        clear it for a new run with overwrite."""
        if self.out_dir is not None and self.ranks.main and self._lock is None:
            self._lock = hold_out_dir(self.out_dir)
        if self._needs_prepare:
            prepare_out_dir(self.out_dir, overwrite=self._overwrite)
            self._needs_prepare = False

    def save(self) -> None:
        """Commit the whole run state as a new checkpoint of ``out_dir`` (all files or none)."""
        if self.out_dir is None:
            return
        weights, optimizer = self.parallel.full_state(self.model, self.optimizer)  # every rank
        if not self.ranks.main:  # rank 0 holds the whole state and writes it
            barrier(self.ranks)
            return
        self._prepare()
        state = {
            "step": self.step,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            **rng_state(self.device),
            "history": self.history,
            "loss_window": self._window,
        }
        self.write_checkpoint(state, weights)
        self.plot()  # with every save, so a run stopped by Ctrl-C has its curves too
        self.saved_step = self.step
        barrier(self.ranks)

    def write_checkpoint(self, state: dict[str, Any], weights: dict[str, Any] | None) -> None:
        """Commit the model, tokenizer, run description and ``state`` as the run's new current
        checkpoint (a subclass that saves less of the model writes its own)."""
        assert self.out_dir is not None
        write_checkpoint(
            self.out_dir,
            model=self.model,
            tokenizer=self.task.tokenizer,
            meta={"task": self.task.spec.to_json(), "train": asdict(self.config)},
            state=state,
            made_by=self.made_by,
            weights=weights,
        )

    def load_state(self, state: dict[str, Any], source: str | Path = "trainer state") -> None:
        """Restore the optimizer, scheduler, RNG, step and history of a saved trainer state, and
        rewrite ``log.jsonl`` to match it (for --resume)."""
        try:
            self.parallel.load_optimizer(self.model, self.optimizer, state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state, self.device)
            self.step = int(state["step"])
            self.history = list(state["history"])
            self._window = [float(x) for x in state.get("loss_window", [])]
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise ValueError(f"{source} does not match this model's parameters: {e}") from None
        self.saved_step = self.step
        if self.out_dir is not None and self.ranks.main:
            self._prepare()  # the lock, before the log is rewritten
            write_log(self.out_dir, self.history)

    # --- the loop -------------------------------------------------------------------------------

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.bf16)

    def _batch(self, split: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """This rank's rows of the task's next batch (drawn on the CPU), on the model's device."""
        batch = self.task.batch(split, generator, self.config.batch_size)
        rows = self.ranks.rows(self.config.batch_size)
        return {name: t[rows].to(self.device) for name, t in batch.items()}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over fixed batches (the same ones at every evaluation)."""
        was = self.model.training
        self.model.eval()
        g = torch.Generator().manual_seed(self.config.seed + 7919)
        total = count = 0.0
        with self._autocast():
            for _ in range(self.config.eval_batches):
                loss, n = self._step_loss(self._batch("val", g))
                total += float(loss) * n
                count += n
        total, count = sum_over_ranks(self.ranks, [total, count], self.device)
        self.model.train(was)
        return total / max(count, 1) * self.task.report_scale

    def train(self, *, progress: bool = True, until: int | None = None) -> TrainResult:
        """Run from ``self.step`` to ``config.steps``; returns the figures reached.

        ``until`` stops early at that step and saves, as an interruption would (Ctrl-C also saves
        before it stops); the schedule stays the one planned for ``config.steps``.
        """
        c, task = self.config, self.task
        end = c.steps if until is None else min(until, c.steps)
        self._prepare()  # before the first step: a folder we cannot write fails now, not later
        t0, first_step = time.perf_counter(), self.step
        shown = progress and self.ranks.main  # one bar: rank 0's
        bar = tqdm(
            total=c.steps, initial=self.step, disable=not shown, unit="step", dynamic_ncols=True
        )
        self._interrupted = None
        try:
            with finish_step_on_signals(self._flag_signal):
                tokens = self._loop(bar, end)
        finally:
            bar.close()
        self._interrupted = agree_signal(self.ranks, self._interrupted, self.device)
        if self._interrupted is not None:  # the step in flight finished, so the state is whole
            self.save()
            raise TrainingInterrupted(self._interrupted, self.step, self.out_dir)
        seconds = time.perf_counter() - t0
        rate = tokens / seconds if self.step > first_step else 0.0
        if self.step < c.steps:  # stopped early on request
            self.save()
            nan = float("nan")
            return TrainResult(
                self.step, self._last("loss"), nan, task.unit, seconds, rate, {}, self.out_dir
            )
        val = self.evaluate()
        self._log({"step": self.step, "val_loss": val})
        self.model.eval()
        with self.parallel.whole(self._step_loss):  # the model's methods, outside _step_loss
            metrics = task.evaluate(self.model)
        if metrics:
            self._log({"step": self.step, **metrics})
        self.save()
        return TrainResult(
            self.step, self._last("loss"), val, task.unit, seconds, rate, metrics, self.out_dir
        )

    def _loop(self, bar: Any, end: int) -> int:
        """Optimizer steps up to ``end``; returns the tokens read."""
        c, task = self.config, self.task
        self.model.train()
        t0, tokens, window = time.perf_counter(), 0, self._window
        shown: dict[str, str] = {}  # the progress bar's loss, tokens/s and last validation loss
        stop = False  # agreed by every rank, in the step's all-reduce
        while self.step < end and not stop:
            seed_step(self.ranks, c.seed, self.step)
            batch = self._batch("train", step_generator(c.seed, self.step))
            with self._autocast():
                loss, n = self._step_loss(batch)
            loss, value, stop = reduce_step(self.ranks, loss, n, bool(self._interrupted))
            value *= task.report_scale
            if not math.isfinite(value):
                self._diverged(f"the loss is {value}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # the norm shows a non-finite gradient even when not clipping (max_norm inf scales
            # every gradient by exactly 1.0)
            norm = self.parallel.clip_grad_norm(self.model, c.grad_clip or math.inf)
            if not math.isfinite(norm):
                self._diverged(f"the gradient norm is {norm}")
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            tokens += task.tokens_in(batch) * self.ranks.world
            window.append(value)
            if self.step % c.log_every == 0 or self.step == end:
                rate = tokens / (time.perf_counter() - t0)
                mean = sum(window) / len(window)
                window.clear()
                lr = self.scheduler.get_last_lr()[0]
                self._log({"step": self.step, "loss": mean, "lr": lr, "tokens_per_s": rate})
                shown.update(loss=f"{mean:.3f}", tok_s=f"{rate:,.0f}")
                bar.set_postfix(shown, refresh=False)
            if c.eval_every and self.step % c.eval_every == 0 and self.step < c.steps:
                val = self.evaluate()
                self._log({"step": self.step, "val_loss": val})
                shown["val"] = f"{val:.3f}"
                bar.set_postfix(shown, refresh=False)
            if c.save_every and self.step % c.save_every == 0 and self.step < c.steps:
                self.save()
            bar.update(1)
            stop = stop or (not self.ranks.parallel and self._interrupted is not None)
        return tokens

    def _flag_signal(self, signum: int) -> None:
        self._interrupted = signum  # the loop stops after the step in flight

    def _diverged(self, what: str) -> None:
        raise DivergedError.at(self.step + 1, what, self.saved_step, self.out_dir)

    def _last(self, key: str) -> float:
        return next((r[key] for r in reversed(self.history) if key in r), float("nan"))

    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.out_dir is not None and self.ranks.main:
            self._prepare()
            append_log(self.out_dir, record)

    def plot(self) -> Path | None:
        """Training and validation loss against step, as ``loss.png``."""
        if self.out_dir is None or not self.ranks.main:
            return None
        path = self.out_dir / PLOT_FILE
        title = f"{self.task.spec.task} · {self.task.spec.preset}"
        atomic_write(
            path, lambda tmp: plot_losses(self.history, tmp, title=title, unit=self.task.unit)
        )
        return path


def resume_trainer(
    out_dir: str | Path,
    *,
    steps: int | None = None,
    verify: bool = True,
    device: str | torch.device = "cpu",
    parallel: str = "ddp",
) -> Trainer:
    """Rebuild the task, model and trainer saved in ``out_dir`` and restore their state; the
    run continues on ``device`` and under ``parallel`` (whichever it was trained with).

    Every file of the checkpoint is checked against its SHA-256 first (``verify=False`` skips
    that). ``steps`` extends the run (the cosine schedule is then re-planned to the new end);
    fewer steps than are done, or resuming a finished run without more steps, is refused
    before anything is written.
    """
    d = Path(out_dir)
    saved = read_checkpoint(d, verify=verify)
    try:
        spec = TaskSpec(**saved.meta["task"])
        config = TrainConfig(**saved.meta["train"])
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{saved.folder / TASK_FILE} is not a valid run description: {e}"
        ) from None
    config = extended(config, int(saved.state["step"]), steps, d)
    task = build_task(spec, tokenizer=load_tokenizer(saved.folder, verify=False))  # checked
    task.model = type(task.model).load(saved.folder, verify=False)  # type: ignore[attr-defined]
    made_by = saved.made_by or "dikkat.Trainer"
    trainer = Trainer(
        task, config, d, made_by=made_by, device=device, parallel=parallel, _resuming=True
    )
    trainer.load_state(saved.state, saved.folder / STATE_FILE)
    return trainer


def train(
    spec: TaskSpec,
    config: TrainConfig,
    out_dir: str | Path | None = None,
    *,
    progress: bool = True,
    overwrite: bool = False,
    device: str | torch.device = "cpu",
    parallel: str = "ddp",
) -> TrainResult:
    """Build ``spec``'s task and model and train them on ``device``; the one-call entry point."""
    if out_dir is not None:  # refuse a folder in use before building anything
        check_out_dir(Path(out_dir), overwrite=overwrite)
    task = build_task(spec)
    trainer = Trainer(task, config, out_dir, overwrite=overwrite, device=device, parallel=parallel)
    return trainer.train(progress=progress)
