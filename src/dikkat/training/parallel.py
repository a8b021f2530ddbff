"""Data-parallel training on ``torch.distributed``: one process per device, each computing the
loss of its own rows of every step's batch (docs/distributed-training.md).

Under ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``) :func:`detect_ranks` joins the process group — gloo on the CPU, NCCL on CUDA —
unless the caller already has. The model is wrapped in ``DistributedDataParallel`` (Li et al.
2020, arXiv:2006.15704), which averages the gradients of the ranks during the backward pass.

``TrainConfig.batch_size`` is the batch of a whole step, all ranks together: every rank draws the
step's batch from the same generator (:func:`dikkat.tasks.step_generator`) and keeps its rows
(:meth:`Ranks.rows`), so N ranks see exactly the examples one process would, and a run resumes
with any number of processes. Each rank's loss is weighted by its share of the step's predicted
tokens before the backward pass, so the averaged gradient is the gradient of the mean over all
of them even where ranks predict different numbers of tokens (``mlm`` predicts its masked ones).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from dikkat.tasks import Task


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1  # processes training together
    local_rank: int = 0  # rank on this machine: which GPU it drives

    @property
    def main(self) -> bool:
        """Rank 0: the one process that writes the run folder, logs and shows progress."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a batch of ``batch_size`` (every rank gets as many)."""
        if batch_size % self.world:
            raise ValueError(
                f"batch_size {batch_size} is not a multiple of the {self.world} training "
                f"processes: each must get as many rows of every step's batch"
            )
        per_rank = batch_size // self.world
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"the environment variable {name}={value!r} is not a whole number"
        ) from None


def detect_ranks(device: torch.device) -> Ranks:
    """The process group this process trains in: the caller's if one is initialised, else the
    one ``torchrun``'s environment describes (joined here), else none (rank 0 of 1)."""
    local = _env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), local)
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Ranks()
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world} but this PyTorch has no torch.distributed")
    # CPU tensors (the step's loss on the CPU, objects) go through gloo beside NCCL on CUDA
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)  # env:// — MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    return Ranks(dist.get_rank(), dist.get_world_size(), local)


def rank_device(device: torch.device, ranks: Ranks) -> torch.device:
    """``cuda`` without an index means this rank's GPU (``cuda:LOCAL_RANK``) when several
    processes train; any other device is kept."""
    if ranks.parallel and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", ranks.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class StepLoss(nn.Module):
    """``task.loss(model, batch)`` as a module's forward: DistributedDataParallel syncs the
    gradients of what its own forward computes, and tasks call methods such as ``GPT.loss``."""

    def __init__(self, task: Task, model: nn.Module) -> None:
        super().__init__()
        self.task = task
        self.model = model

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        return self.task.loss(self.model, batch)


def wrap(task: Task, model: nn.Module, ranks: Ranks, device: torch.device) -> nn.Module:
    """The module the training loop calls: ``StepLoss``, inside DistributedDataParallel when
    several processes train (which broadcasts rank 0's weights to the others first)."""
    step_loss = StepLoss(task, model)
    if not ranks.parallel:
        return step_loss
    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(step_loss, device_ids=ids)


def reduce_step(ranks: Ranks, loss: Tensor, n: int, stop: bool) -> tuple[Tensor, float, bool]:
    """(the loss to back-propagate, the step's mean loss over all ranks, whether any rank was
    asked to stop) — one all-reduce per step, so every rank decides the same."""
    if not ranks.parallel:
        return loss, loss.item(), stop
    stats = torch.stack(
        [loss.detach().double() * n, loss.new_tensor(float(n), dtype=torch.float64)]
    )
    stats = torch.cat([stats, stats.new_tensor([float(stop)])])
    dist.all_reduce(stats)
    total, count, stops = stats.tolist()
    # DDP averages over the ranks: n × world / count makes that average the gradient of the
    # mean over every predicted token of the step
    return loss * (n * ranks.world / count), total / count, stops > 0


def sum_over_ranks(ranks: Ranks, values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums over the ranks (the values themselves with one process)."""
    if not ranks.parallel:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def agree_signal(ranks: Ranks, signum: int | None, device: torch.device) -> int | None:
    """The signal any rank was stopped by (all ranks return the same), or None."""
    if not ranks.parallel:
        return signum
    t = torch.tensor([signum or 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) or None


def barrier(ranks: Ranks) -> None:
    if ranks.parallel:
        dist.barrier()


def seed_step(ranks: Ranks, seed: int, step: int) -> None:
    """With several processes, seed each rank's dropout from (seed, step, rank): the ranks draw
    different masks, and a resumed run draws the ones it would have (no RNG state to gather)."""
    if ranks.parallel:
        torch.manual_seed((seed * 1_000_003 + step) * 65_537 + ranks.rank)


def release(ranks: Ranks) -> Any:
    """Leave the process group at the end of a command (a no-op with one process), once the
    caller holds no module :func:`wrap` returned. DistributedDataParallel's reducer keeps the
    group alive; where the reducer is freed after the group was destroyed, the group's
    destructor runs inside the reducer's, with the GIL held, and joins gloo's worker threads —
    and a worker that is just freeing a tensor which Python let go of waits for the GIL: the
    process hangs at its end (pytorch/pytorch#56297 lists such destructors). So the wrapper
    goes first (a collection frees it if a cycle holds it), then the group."""
    if ranks.parallel and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
