"""Tasks: what a batch is, what the loss is, how to judge the model — and the registry of them.

A task owns its tokenizer and data and builds its model from a config; it is described by a
JSON-able :class:`TaskSpec`, which a checkpoint stores so that ``--resume`` can rebuild it. Each
task registers a :class:`TaskInfo` — how to build it, its training recipe and the size flags the
command line offers — so adding a task is adding one module that calls :func:`register_task`.
The built-in ones (:mod:`dikkat.tasks`): ``lm`` (GPT), ``mlm`` (BERT), ``translate`` (the
encoder-decoder), ``digits`` (a ViT) and ``shapes`` (a DETR-style detector).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.models.io import available_memory, meta_modules
from dikkat.validate import check_choice, check_int


@dataclass(frozen=True)
class TaskSpec:
    """Everything needed to rebuild a task: JSON-able, stored with each checkpoint."""

    task: str = "lm"  # a registered task (task_names())
    preset: str = "tiny"  # the model preset
    model_overrides: dict[str, Any] = field(default_factory=dict)  # config fields to change
    data: str | None = None  # text file or folder; None = the Python standard library
    tokenizer: str = "bytes"  # bytes | bpe
    vocab_size: int = 1024  # BPE vocabulary
    seq_len: int = 256  # training window (lm, mlm)
    max_bytes: int | None = None  # cap on the training text
    seed: int = 0  # data split and model initialisation

    def __post_init__(self) -> None:
        check_choice("task", self.task, task_names())
        check_choice("tokenizer", self.tokenizer, ("bytes", "bpe"))
        if not isinstance(self.preset, str):
            raise TypeError(f"preset must be a str, got {type(self.preset).__name__}")
        if not isinstance(self.model_overrides, dict):
            raise TypeError(
                f"model_overrides must be a dict, got {type(self.model_overrides).__name__}"
            )
        if self.data is not None and not isinstance(self.data, str):
            raise TypeError(f"data must be a path (str) or None, got {type(self.data).__name__}")
        # a byte-level BPE starts from the 256 bytes: a smaller vocabulary cannot hold them
        check_int("vocab_size", self.vocab_size, at_least=256)
        check_int("seq_len", self.seq_len, at_least=2)
        check_int("max_bytes", self.max_bytes, at_least=1, optional=True)
        check_int("seed", self.seed, at_least=0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Task:
    """Base class: a model, a tokenizer, batches and a loss."""

    spec: TaskSpec
    model: nn.Module
    tokenizer: Any
    unit = "nats/token"  # what reported losses are in
    report_scale = 1.0  # reported loss = training loss (nats/token) × report_scale

    def batch(self, split: str, generator: torch.Generator, batch_size: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        """(mean loss over the predicted tokens, number of predicted tokens)."""
        raise NotImplementedError

    def tokens_in(self, batch: dict[str, Tensor]) -> int:
        """Tokens the model reads in this batch (for tokens/s)."""
        return sum(int(t.numel()) for t in batch.values() if t.dtype == torch.long)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Extra task metrics (beyond validation loss), computed at the end of training."""
        return {}


def step_generator(seed: int, step: int) -> torch.Generator:
    """The data generator of one training step: a pure function of (seed, step), so a resumed run
    draws exactly the batches the uninterrupted run would have."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


# bytes per parameter while training: fp32 weights and gradients, AdamW's two moments
TRAINING_BYTES_PER_PARAMETER = 16


def new_model(cls: type[nn.Module], config: Any) -> nn.Module:
    """``cls(config)``, after checking on the meta device (no memory) that training it fits in
    the memory the machine has: a size that does not fit is an error naming the parameter
    count, not a crash of the allocator or a visit from the out-of-memory killer."""
    with meta_modules():
        n = sum(p.numel() for p in cls(config).parameters())
    need, have = n * TRAINING_BYTES_PER_PARAMETER, available_memory()
    if have is not None and need > have:
        raise ValueError(
            f"a {cls.__name__} of {n:,} parameters needs {need / 2**30:,.1f} GiB to train "
            f"(weights, gradients, AdamW state), more than the {have / 2**30:,.1f} GiB available; "
            "choose a smaller preset or d_model / n_layers"
        )
    return cls(config)


# --- the registry ---------------------------------------------------------------------------

# `dikkat train` settings a task's recipe does not name
DEFAULT_RECIPE: dict[str, Any] = {
    "preset": "tiny",
    "steps": 1000,
    "batch_size": 32,
    "lr": 1e-3,
    "warmup": 100,
    "eval_every": 100,
}


# the size flags of a plain stack of blocks → its config fields (most tasks' size_flags)
BLOCK_SIZES: dict[str, str | tuple[str, ...]] = {
    "d_model": "d_model",
    "layers": "n_layers",
    "heads": "n_heads",
    "dropout": "dropout",
}


@dataclass(frozen=True)
class TaskInfo:
    """A task as the registry and the command line know it."""

    name: str  # --task NAME
    build: Callable[[TaskSpec, Any], Task]  # (spec, the saved tokenizer or None) → the task
    help: str  # one line: which model learns what
    recipe: dict[str, Any]  # `dikkat train --task NAME` defaults, over DEFAULT_RECIPE
    size_flags: dict[str, str | tuple[str, ...]]  # command-line size flag → model config field(s)
    # extra lines printed after training, from the final metrics (None: nothing more)
    summary: Callable[[dict[str, float], float], str | None] | None = None

    def training(self) -> dict[str, Any]:
        """The whole recipe: DEFAULT_RECIPE with this task's own values over it."""
        return {**DEFAULT_RECIPE, **self.recipe}


_REGISTRY: dict[str, TaskInfo] = {}


def register_task(info: TaskInfo) -> TaskInfo:
    """Add a task to the registry (or replace the one of that name); returns it."""
    if not isinstance(info, TaskInfo):
        raise TypeError(f"register_task takes a TaskInfo, got {type(info).__name__}")
    unknown = set(info.recipe) - set(DEFAULT_RECIPE)
    if unknown:
        raise ValueError(f"task {info.name!r}: unknown recipe keys {sorted(unknown)}")
    _REGISTRY[info.name] = info
    return info


def task_names() -> tuple[str, ...]:
    """The registered tasks, in the order they were registered."""
    return tuple(_REGISTRY)


def task_info(name: str) -> TaskInfo:
    """The registered task ``name``; ``ValueError`` naming the choices otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; choose one of {task_names()}")
    return _REGISTRY[name]


def build_task(spec: TaskSpec, tokenizer: Any | None = None) -> Task:
    """The task a spec describes (``tokenizer``: reuse a saved one instead of training/choosing)."""
    return task_info(spec.task).build(spec, tokenizer)
