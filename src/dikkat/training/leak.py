"""Training without the causal mask, made visible (docs/contract.md §5): a fake loss.

Without the mask, position t attends to position t + 1 — the very token it is asked to predict —
so the model learns to copy it: the training loss falls far below what any honest model reaches.
That loss is fake. Evaluated causally (no peeking, as at generation time, where the future does
not exist yet) the same model is worse than one trained with the mask, and it generates worse.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from dikkat.core.masks import causal, full
from dikkat.tasks import TaskSpec
from dikkat.tasks.lm import LMTask
from dikkat.training.trainer import TrainConfig, Trainer


@dataclass(frozen=True)
class LeakRun:
    """One of the two models: its training loss (with the mask it trained under), its loss
    evaluated causally on validation text, and a greedy sample."""

    name: str
    train_loss: float  # nats/byte, as trained (with or without the mask)
    causal_val_loss: float  # nats/byte, evaluated honestly
    sample: str


@dataclass(frozen=True)
class LeakResult:
    masked: LeakRun
    unmasked: LeakRun
    steps: int
    seconds: float


@torch.no_grad()
def _loss_with(
    task: LMTask, model: torch.nn.Module, split: str, mask, batches: int, batch_size: int
) -> float:
    g = torch.Generator().manual_seed(4242)
    device = next(model.parameters()).device
    total = 0.0
    for _ in range(batches):
        batch = {name: t.to(device) for name, t in task.batch(split, g, batch_size).items()}
        loss, _ = task.loss(model, batch, mask=mask)
        total += float(loss)
    return total / batches * task.report_scale


def leak_demo(
    *,
    steps: int = 300,
    batch_size: int = 16,
    seq_len: int = 64,
    d_model: int = 64,
    n_layers: int = 2,
    prompt: str = "def ",
    sample_tokens: int = 60,
    data: str | None = None,
    max_bytes: int | None = 2_000_000,
    seed: int = 0,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> LeakResult:
    """Train the same tiny GPT (same initial weights, same batches) with and without the causal
    mask on ``device``, then compare training loss, causal validation loss and a greedy
    sample."""
    import time

    t0 = time.perf_counter()
    spec = TaskSpec(
        task="lm",
        seq_len=seq_len,
        data=data,
        max_bytes=max_bytes,
        seed=seed,
        model_overrides={
            "d_model": d_model,
            "n_layers": n_layers,
            "n_heads": 4,
            "max_len": seq_len,
            "position": "rope",  # relative positions: "look one ahead" is one pattern to learn
        },
    )
    masked = LMTask(spec)
    unmasked = copy.copy(masked)  # shares the corpus and tokenizer
    unmasked.model = copy.deepcopy(masked.model)  # the same initial weights
    unmasked.mask = full()  # every position sees every other one, the next token included
    config = TrainConfig(
        steps=steps,
        batch_size=batch_size,
        lr=3e-3,
        warmup=min(30, steps // 5),
        eval_every=0,
        seed=seed,
    )
    runs = []
    for name, task in (("masked (causal)", masked), ("unmasked (leaks the future)", unmasked)):
        trainer = Trainer(task, config, device=device)
        if progress:
            print(f"  training the {name} model")
        trainer.train(progress=progress)
        model = task.model.eval()
        train_loss = _loss_with(task, model, "train", task.mask, 8, batch_size)
        honest = _loss_with(task, model, "val", causal(), 8, batch_size)
        ids = model.generate([task.tokenizer.encode(prompt)], sample_tokens)[0]  # KV cache: causal
        runs.append(LeakRun(name, train_loss, honest, task.tokenizer.decode(ids)))
    return LeakResult(runs[0], runs[1], steps, time.perf_counter() - t0)
