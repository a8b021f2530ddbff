"""How the training processes hold the model: whole on every rank (``ddp``), or sharded
(``fsdp``) — docs/distributed-training.md.

``ddp``: one process, or ``DistributedDataParallel`` (:func:`dikkat.training.parallel.wrap`);
every rank holds the whole model, its gradients and AdamW's two moments.

``fsdp``: FSDP2, ``torch.distributed.fsdp.fully_shard`` (Zhao et al. 2023, arXiv:2304.11277).
Every parameter, its gradient and its AdamW moments are DTensors of which each rank keeps one
slice of dim 0. Each Transformer block (:class:`dikkat.layers.block.Block`) is one unit: its
weights are all-gathered for its forward, freed, gathered again for its backward, and its
gradients reduce-scattered. The root unit is the :class:`StepLoss` around the whole model, so
what lies outside the blocks (embeddings, a tied output head, final norms, task heads) is
gathered for the whole of ``task.loss`` — ``GPT.loss`` reads ``lm_head.weight`` after the
forward. A model without blocks is one unit, gathered whole.

A checkpoint is the one a single process writes. Every rank takes part in the gathers of
``torch.distributed.checkpoint.state_dict`` (full tensors, offloaded to the CPU) and rank 0,
which alone receives them, writes. On disk the optimizer state keeps the format of
``torch.optim.Optimizer.state_dict()`` (parameters numbered in the order of the optimizer's
groups); the state-dict API's form, keyed by parameter names, is converted to it and back, so a
checkpoint resumes in 1 process, in N under ``ddp`` or in N under ``fsdp``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from dikkat.layers.block import Block
from dikkat.tasks import Task
from dikkat.training.parallel import Ranks, StepLoss, wrap
from dikkat.validate import check_choice

Weights = dict[str, Tensor]


class DDP:
    """Every rank holds the whole model and optimizer (one process, or DDP)."""

    name = "ddp"

    def wrap(self, task: Task, model: nn.Module, ranks: Ranks, device: torch.device) -> nn.Module:
        """The module the training loop calls: ``(loss, n) = module(batch)``."""
        return wrap(task, model, ranks, device)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip the gradients to a global norm of ``max_norm`` (``inf``: only measure it);
        returns the norm before clipping, the same on every rank."""
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        # sharded gradients give a DTensor norm; full_tensor() sums the ranks' parts
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[Weights | None, dict[str, Any]]:
        """(the weights to save, None: the model's own; the optimizer's ``state_dict()``), as
        rank 0 writes them. Called on every rank."""
        return None, optimizer.state_dict()

    def load_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Restore an optimizer ``state_dict()`` (every rank holds all of it)."""
        optimizer.load_state_dict(state)

    def whole(self, step_loss: nn.Module) -> AbstractContextManager[None]:
        """A context in which the model's own methods can be called outside ``step_loss``
        (``task.evaluate`` generates, classifies, …)."""
        return nullcontext()


class ShardedStepLoss(StepLoss):
    """``StepLoss`` whose every forward starts from rank 0's buffers, as DDP's does (BatchNorm's
    running statistics would otherwise drift apart, each rank seeing only its rows)."""

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        for buffer in self.model.buffers():
            dist.broadcast(buffer, 0)
        return super().forward(batch)


def _reshard_without_backward(module: nn.Module, args: Any, output: Any) -> None:
    # FSDP keeps the root's weights gathered after its forward for the backward that follows;
    # an evaluation has none, so free them here
    if not torch.is_grad_enabled():
        module.reshard()  # type: ignore[operator]


class FSDP(DDP):
    """Every rank holds one shard of each parameter, gradient and AdamW moment (FSDP2)."""

    name = "fsdp"
    OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def wrap(self, task: Task, model: nn.Module, ranks: Ranks, device: torch.device) -> nn.Module:
        mesh = init_device_mesh(device.type, (ranks.world,))
        with torch.no_grad():  # every rank starts from rank 0's weights, as under DDP
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, 0)
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh)
        root = fully_shard(ShardedStepLoss(task, model), mesh=mesh)
        root.register_forward_hook(_reshard_without_backward)
        return root

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[Weights | None, dict[str, Any]]:
        weights = get_model_state_dict(model, options=self.OPTIONS)  # {} on ranks other than 0
        is_tied = getattr(model, "is_tied", lambda name: False)
        weights = {name: t.contiguous() for name, t in weights.items() if not is_tied(name)}
        if not optimizer.state:  # before the first step (the API would take a step to fill it)
            return weights, optimizer.state_dict()
        by_name = get_optimizer_state_dict(model, optimizer, options=self.OPTIONS)
        return weights, numbered(by_name, param_names(model, optimizer)) if by_name else {}

    def load_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        if not state["state"]:  # saved before the first step: hyperparameters only
            optimizer.load_state_dict(state)
            return
        by_name = named(state, param_names(model, optimizer))
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name, options=options)

    @contextmanager
    def whole(self, step_loss: nn.Module) -> Iterator[None]:
        # the root's weights gathered; each block gathers its own in its forward
        if not isinstance(step_loss, FSDPModule):
            raise TypeError(f"step_loss must be the module FSDP.wrap returned, got {step_loss}")
        step_loss.unshard()
        try:
            yield
        finally:
            step_loss.reshard()


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of the optimizer's parameters in ``model``, group by group (a tied parameter
    under its first name, as ``named_parameters`` gives it)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def numbered(by_name: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (``get_optimizer_state_dict``) in the form of
    ``Optimizer.state_dict()``: parameters numbered 0, 1, … through the groups ``names`` lists."""
    index = {name: i for i, name in enumerate(n for group in names for n in group)}
    groups = by_name["param_groups"]
    if [g["params"] for g in groups] != names:
        raise ValueError(
            f"the gathered optimizer state lists its parameters as {[g['params'] for g in groups]}"
            f", not in the optimizer's order {names}"
        )
    return {
        "state": {index[name]: s for name, s in by_name["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }


def named(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """The inverse of :func:`numbered`: an ``Optimizer.state_dict()`` keyed by the names of the
    parameters its numbers stand for, position by position in each group."""
    groups = state["param_groups"]
    saved, own = [len(g["params"]) for g in groups], [len(group) for group in names]
    if saved != own:
        raise ValueError(
            f"the saved optimizer has groups of {saved} parameters, this model's {own}"
        )
    name_of = {
        i: n
        for g, group in zip(groups, names, strict=True)
        for i, n in zip(g["params"], group, strict=True)
    }
    return {
        "state": {name_of[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": group} for g, group in zip(groups, names, strict=True)],
    }


STRATEGIES: dict[str, type[DDP]] = {"ddp": DDP, "fsdp": FSDP}


def strategy(name: str, ranks: Ranks) -> DDP:
    """The strategy called ``name`` (``ddp`` or ``fsdp``); with one process there is nothing
    to share or shard, and both train as one process does."""
    check_choice("parallel", name, STRATEGIES)
    return STRATEGIES[name]() if ranks.parallel else DDP()
