"""The ``lm`` task: a GPT learns next-token prediction on a text corpus (causal)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dikkat.core.masks import Mask
from dikkat.models.gpt import GPT, GPTConfig
from dikkat.tasks.base import TaskInfo, TaskSpec, new_model, register_task
from dikkat.tasks.corpus import CorpusTask, random_windows


class LMTask(CorpusTask):
    """GPT next-token prediction."""

    unit = "nats/byte"

    def __init__(
        self, spec: TaskSpec, tokenizer: Any | None = None, mask: Mask | None = None
    ) -> None:
        super().__init__(spec, tokenizer)
        overrides = {"vocab_size": self.tokenizer.vocab_size, **spec.model_overrides}
        config = GPTConfig.preset(spec.preset, **overrides)
        if config.max_len < spec.seq_len:
            config = GPTConfig.preset(spec.preset, **{**overrides, "max_len": spec.seq_len})
        torch.manual_seed(spec.seed)
        self.model = new_model(GPT, config)
        self.mask = mask  # None = causal (the only honest choice; see the leak demo)

    def batch(self, split: str, generator: torch.Generator, batch_size: int) -> dict[str, Tensor]:
        x, y = random_windows(self.ids[split], batch_size, self.spec.seq_len, generator)
        return {"x": x, "y": y}

    def loss(
        self, model: nn.Module, batch: dict[str, Tensor], mask: Mask | None = None
    ) -> tuple[Tensor, int]:
        # GPT.loss = cross_entropy(model(x), y) without holding the (B, T, V) logits
        loss = model.loss(batch["x"], batch["y"], self.mask if mask is None else mask)
        return loss, batch["y"].numel()

    def tokens_in(self, batch: dict[str, Tensor]) -> int:
        return batch["x"].numel()


register_task(
    TaskInfo(
        name="lm",
        build=lambda spec, tokenizer: LMTask(spec, tokenizer),
        help="GPT, next-token prediction on text (the Python standard library, or --data)",
        recipe={},
        size_flags={
            "d_model": "d_model",
            "layers": "n_layers",
            "heads": "n_heads",
            "kv_heads": "n_kv_heads",
            "position": "position",
            "dropout": "dropout",
        },
    )
)
