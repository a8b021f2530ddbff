"""The ``shapes`` task: a small DETR learns to find coloured shapes (docs/contract.md §14).

Training images are drawn fresh at every step (an endless stream from the training seed); the
validation images are a fixed set from the validation stream, never seen in training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dikkat.tasks.base import BLOCK_SIZES, Task, TaskInfo, TaskSpec, new_model, register_task
from dikkat.text import NoTokenizer
from dikkat.vision.detr import DETR, DETRConfig, DETROutput, detection_metrics, detr_loss
from dikkat.vision.shapes import SHAPE_NAMES, ShapesConfig, make_batch

# What plain `dikkat train --task shapes` runs: a few CPU minutes.
SHAPES_TRAINING: dict[str, Any] = {
    "preset": "tiny",
    "steps": 2000,
    "batch_size": 32,
    "lr": 2e-3,
    "warmup": 100,
    "eval_every": 500,
}

VAL_IMAGES = 512  # the fixed validation set
_INDEX_RANGE = 2**31  # training images are drawn from image indices 0 … 2^31 − 1


def shapes_config(spec: TaskSpec, data: ShapesConfig) -> DETRConfig:
    """The DETR config a shapes spec asks for; the data fix image size and classes."""
    config = DETRConfig.preset(spec.preset, **spec.model_overrides)
    if config.image_size != data.image_size or config.n_classes != len(SHAPE_NAMES):
        raise ValueError(
            f"the shapes images are {data.image_size}×{data.image_size} with "
            f"{len(SHAPE_NAMES)} classes; the DETR config has image_size={config.image_size}, "
            f"n_classes={config.n_classes}"
        )
    if config.n_queries < data.max_shapes:
        raise ValueError(
            f"n_queries={config.n_queries} is fewer than the {data.max_shapes} shapes an image "
            "can hold"
        )
    return config


class ShapesTask(Task):
    """Detect the shapes with a DETR trained by Hungarian matching.

    ``data`` changes the generated images (e.g. fewer shapes per image for a quick test).
    """

    unit = "set loss/image"

    def __init__(
        self, spec: TaskSpec, tokenizer: Any | None = None, *, data: ShapesConfig | None = None
    ) -> None:
        # ``tokenizer`` is accepted for the common signature (resume passes the saved one) and
        # ignored: there is nothing to tokenize.
        self.spec = spec
        self.tokenizer = NoTokenizer()
        self.data = data or ShapesConfig()
        config = shapes_config(spec, self.data)
        torch.manual_seed(spec.seed)
        self.model = new_model(DETR, config)
        self.val = make_batch(range(VAL_IMAGES), split="val", seed=spec.seed, config=self.data)

    def batch(self, split: str, generator: torch.Generator, batch_size: int) -> dict[str, Tensor]:
        if split == "train":
            idx = torch.randint(0, _INDEX_RANGE, (batch_size,), generator=generator)
            images, labels, boxes = make_batch(
                idx, split="train", seed=self.spec.seed, config=self.data
            )
        else:
            idx = torch.randperm(VAL_IMAGES, generator=generator)[:batch_size]
            images, labels, boxes = (t[idx] for t in self.val)
        return {"images": images, "labels": labels, "boxes": boxes}

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        out = model(batch["images"])
        loss, _ = detr_loss(out, batch["labels"], batch["boxes"])
        return loss, len(batch["images"])

    def tokens_in(self, batch: dict[str, Tensor]) -> int:
        """Tokens the decoder attends to: feature-grid cells of every image."""
        return len(batch["images"]) * self.model.config.grid**2

    @torch.no_grad()
    def predict(self, model: nn.Module, images: Tensor, chunk: int = 128) -> DETROutput:
        """The model's output on many images, in chunks, in evaluation mode (on the CPU,
        wherever the model runs)."""
        was = model.training
        model.eval()
        device = next(model.parameters()).device
        outs = [model(images[i : i + chunk].to(device)) for i in range(0, len(images), chunk)]
        model.train(was)
        logits, boxes = torch.cat([o.logits for o in outs]), torch.cat([o.boxes for o in outs])
        return DETROutput(logits.cpu(), boxes.cpu())

    def baseline(self) -> dict[str, float]:
        """A model that ignores the image: every query says the commonest training class with
        the mean training box (from 2,048 training images)."""
        _, labels, boxes = make_batch(
            range(2048), split="train", seed=self.spec.seed, config=self.data
        )
        real = labels >= 0
        K, N = len(SHAPE_NAMES), self.model.config.n_queries
        logits = torch.zeros(len(self.val[0]), N, K + 1)
        logits[..., int(labels[real].bincount().argmax())] = 1.0
        mean_box = boxes[real].mean(0).expand(len(self.val[0]), N, 4)
        return detection_metrics(logits, mean_box, self.val[1], self.val[2])

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        images, labels, boxes = self.val
        out = self.predict(model, images)
        metrics = detection_metrics(out.logits, out.boxes, labels, boxes)
        base = self.baseline()
        return {**metrics, "baseline_matching_accuracy": base["matching_accuracy"]}


register_task(
    TaskInfo(
        name="shapes",
        build=lambda spec, tokenizer: ShapesTask(spec, tokenizer),
        help="DETR-style object queries find generated coloured shapes (Hungarian matching)",
        recipe=SHAPES_TRAINING,
        size_flags=BLOCK_SIZES,
    )
)
