"""How to train (the what is the task's ``TaskSpec``): AdamW, warmup then cosine, clipping.

The schedule: a linear warmup to the peak learning rate, then a cosine down to ``min_lr_ratio``
of it at the last step (Loshchilov & Hutter 2017, arXiv:1608.03983, without restarts). AdamW
(Loshchilov & Hutter 2019, arXiv:1711.05101) decays the matrices only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from dikkat.validate import check_bool, check_float, check_int


@dataclass(frozen=True)
class TrainConfig:
    """How to train (the what is the :class:`TaskSpec`)."""

    steps: int = 1000  # optimizer steps
    batch_size: int = 32  # sequences per step
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decays to lr × this
    warmup: int = 100  # linear warmup steps
    weight_decay: float = 0.1  # AdamW, on matrices only
    beta2: float = 0.99  # AdamW β₂ (β₁ = 0.9)
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    bf16: bool = False  # bf16 autocast for forward and backward
    eval_every: int = 100  # steps between validation losses; 0 = only at the end
    eval_batches: int = 8  # validation batches per evaluation
    log_every: int = 10  # steps between log lines
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    seed: int = 0  # data order and dropout

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_batches", "log_every"):
            check_int(name, getattr(self, name), at_least=1)
        for name in ("warmup", "eval_every", "save_every", "seed"):
            check_int(name, getattr(self, name), at_least=0)
        check_float("lr", self.lr, low=0.0, low_open=True)
        check_float("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        check_float("weight_decay", self.weight_decay, low=0.0)
        check_float("beta2", self.beta2, low=0.0, high=1.0, high_open=True)
        check_float("grad_clip", self.grad_clip, low=0.0)
        check_bool("bf16", self.bf16)


def extended(config: TrainConfig, done: int, steps: int | None, run: object) -> TrainConfig:
    """The config a run of ``run`` at step ``done`` resumes with: ``steps`` more in all where
    given (the cosine then re-planned to the new end); fewer than are done, or a finished run
    without more, is refused before anything is written."""
    if steps is None:
        if done >= config.steps:
            raise ValueError(
                f"{run} has finished its {config.steps} steps; pass --steps N (N > {done}) to "
                "extend it"
            )
        return config
    if steps <= done:
        raise ValueError(
            f"{run} is at step {done}; --steps {steps} would end at or before it (pass more "
            "steps to extend the run)"
        )
    return dataclasses.replace(config, steps=steps)


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 natively and safely: AVX512-BF16 and no AMX. oneDNN
    emulates bf16 on other AVX-512 CPUs (slower than fp32), and AMX is left to be asked for:
    one Xeon VM reports AMX while its tile loads fault (SIGILL). False where the flags cannot
    be read (not Linux)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags and not any(flag.startswith("amx") for flag in flags)


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup to 1, then a cosine from 1 down to ``min_lr_ratio`` at the last step."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    span = max(1, config.steps - config.warmup)
    progress = min(1.0, (step - config.warmup) / span)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (
        1 + math.cos(math.pi * progress)
    )


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or 1-D gains)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused: one kernel per step for all parameters, the same update up to rounding; on CPU it
    # is several times faster than foreach, which falls back to a loop there (BENCHMARKS.md)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, config.beta2), fused=True)
