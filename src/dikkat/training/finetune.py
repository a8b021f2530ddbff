"""Fine-tuning a pretrained decoder with LoRA adapters: the run, its data, resuming, and loading
the result back.

``finetune(model, data, out_dir)`` loads the model as :func:`dikkat.pretrained.load` gives it
(a GGUF file's weights stay packed), gives it adapters (:mod:`dikkat.training.lora`), reads the
JSONL data (:mod:`dikkat.training.sft_data`: chat in the model's own template, loss on the
assistant's tokens) and packs it into rows of ``seq_len`` tokens with a document mask, so that
no example attends to another; then trains with dikkat's loop (:class:`~dikkat.training.Trainer`:
warmup and cosine, clipping, eval on the held-out split, Ctrl-C saves, ``--resume``).

A checkpoint of a fine-tune holds only what was trained — the adapter, in PEFT's format::

    run.json, log.jsonl, loss.png
    checkpoint-000200/  adapter_config.json, adapter_model.safetensors   (PEFT reads these)
                        task.json (the base model, data and settings), trainer_state.pt,
                        manifest.json

:func:`load_finetuned` gives the base model with the run's adapters as a
:class:`~dikkat.pretrained.Pretrained`, to chat with or export.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from dikkat import runs
from dikkat.core.masks import document
from dikkat.pretrained import Pretrained, load
from dikkat.pretrained.families import Family, by_gguf_architecture, by_hf_model_type
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.tasks.base import Task
from dikkat.training.checkpoint import (
    STATE_FILE,
    TASK_FILE,
    check_out_dir,
    read_checkpoint,
    writing,
)
from dikkat.training.config import TrainConfig, extended
from dikkat.training.lora import LoraConfig, Site, add_lora
from dikkat.training.packing import IGNORE, Packed, batch_rows, pack
from dikkat.training.peft_format import load_peft_state, lora_config_of, peft_config, peft_state
from dikkat.training.results import TrainResult
from dikkat.training.sft_data import read_examples, split_examples
from dikkat.training.trainer import Trainer
from dikkat.validate import check_bool, check_float, check_int

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "FinetuneSpec",
    "Finetuner",
    "family_of",
    "finetune",
    "finetuner",
    "is_finetune",
    "load_finetuned",
    "resume_finetune",
]

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file names (peft.utils.constants)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class FinetuneSpec:
    """What a fine-tune starts from: the base model (what :func:`dikkat.pretrained.load` takes),
    the JSONL data, the rows it is packed into, the held-out share, the adapters, and whether
    the blocks' activations are recomputed in the backward pass instead of kept."""

    model: str
    data: str
    seq_len: int = 512
    eval_fraction: float = 0.1
    checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    task: str = "finetune"  # what a run's curves are titled with

    def __post_init__(self) -> None:
        for name in ("model", "data"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(
                    f"{name} must be a str (a path or name), got {getattr(self, name)!r}"
                )
        check_int("seq_len", self.seq_len, at_least=2)
        check_float("eval_fraction", self.eval_fraction, low=0.0, high=1.0, high_open=True)
        check_bool("checkpointing", self.checkpointing)
        if isinstance(self.lora, dict):  # as task.json holds it
            lora = {**self.lora, "targets": tuple(self.lora.get("targets", ()))}
            object.__setattr__(self, "lora", LoraConfig(**lora))
        if not isinstance(self.lora, LoraConfig):
            raise TypeError(f"lora must be a LoraConfig, got {type(self.lora).__name__}")

    @property
    def preset(self) -> str:
        return Path(self.model).name

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def family_of(lm: Pretrained) -> Family:
    """The family table of a loaded model: from its GGUF header or its ``config.json``."""
    path = Path(lm.path)
    if path.is_file():
        return by_gguf_architecture(GGUFFile(path).metadata.get("general.architecture"), str(path))
    config = json.loads((path / "config.json").read_text())
    return by_hf_model_type(config.get("model_type"), str(path))


class FinetuneTask(Task):
    """The packed rows of a fine-tune and its loss: cross-entropy on the trained tokens only,
    whose logits alone are computed (a chat's prompt tokens never reach the output layer)."""

    unit = "nats/token"

    def __init__(self, spec: FinetuneSpec, lm: Pretrained, seed: int) -> None:
        self.spec, self.lm, self.seed = spec, lm, seed
        self.model, self.tokenizer = lm.model, lm.tokenizer
        self.family = family_of(lm)
        examples = read_examples(spec.data, lm)
        train, held = split_examples(examples, spec.eval_fraction, seed)
        self.rows: dict[str, Packed | None] = {
            "train": pack(train, spec.seq_len),
            "val": pack(held, spec.seq_len) if held else None,
        }
        self.sites: list[Site] = add_lora(self.model, self.family, spec.lora)
        if spec.checkpointing:
            recompute_blocks(self.model)

    def step_rows(self, step: int, batch_size: int) -> Tensor:
        """The training rows of optimizer step ``step``: each row once an epoch, in an order
        drawn from (seed, epoch) (:func:`~dikkat.training.packing.batch_rows`)."""
        packed = self.rows["train"]
        assert packed is not None
        return batch_rows(packed.ids.shape[0], batch_size, step, seed=self.seed)

    def rows_batch(self, split: str, rows: Tensor) -> dict[str, Tensor]:
        packed = self.rows[split]
        assert packed is not None
        return {
            "ids": packed.ids[rows],
            "labels": packed.labels[rows],
            "documents": packed.documents[rows],
            "positions": packed.positions[rows],
            "valid": packed.valid[rows],
        }

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        hidden = model(
            batch["ids"],
            mask=document(batch["documents"]),
            positions=batch["positions"],
            return_hidden=True,
        )
        labels = batch["labels"]
        kept = labels != IGNORE
        logits = model.output_logits(hidden[kept])  # type: ignore[operator]
        n = int(kept.sum())
        return F.cross_entropy(logits.float(), labels[kept], reduction="sum") / max(n, 1), n

    def tokens_in(self, batch: dict[str, Tensor]) -> int:
        return int(batch["valid"].sum())  # the rows' tokens, not their padding


def recompute_blocks(model: nn.Module) -> None:
    """Activation checkpointing: each block's activations are recomputed in the backward pass
    instead of kept (Chen et al. 2016, arXiv:1604.06174; ``torch.utils.checkpoint``), so a
    step holds one block's activations at a time beside the blocks' inputs."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:  # type: ignore[attr-defined]
        forward = type(block).forward.__get__(block)
        block.forward = functools.partial(checkpoint, forward, use_reentrant=False)


class Finetuner(Trainer):
    """dikkat's training loop on a :class:`FinetuneTask`: the model stays where it is loaded
    (packed weights do not move), the held-out split is evaluated whole, and a checkpoint is
    the adapter in PEFT's format (module docstring)."""

    task: FinetuneTask

    def place(self, model: nn.Module) -> nn.Module:
        if self.device.type != "cpu":
            raise ValueError(f"fine-tuning runs on the CPU here, not {self.device}")
        return model

    def _batch(self, split: str, generator: torch.Generator) -> dict[str, Tensor]:
        rows = self.task.step_rows(self.step, self.config.batch_size)
        return self.task.rows_batch(split, rows)

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss per trained token over the whole held-out split (nan without one)."""
        packed = self.task.rows["val"]
        if packed is None:
            return float("nan")
        was = self.model.training
        self.model.eval()
        total, count, bs = 0.0, 0, self.config.batch_size
        with self._autocast():
            for a in range(0, packed.ids.shape[0], bs):
                rows = torch.arange(a, min(a + bs, packed.ids.shape[0]))
                loss, n = self.task.loss(self.model, self.task.rows_batch("val", rows))
                total, count = total + float(loss) * n, count + n
        self.model.train(was)
        return total / max(count, 1)

    def write_checkpoint(self, state: dict[str, Any], weights: dict[str, Any] | None) -> None:
        assert self.out_dir is not None
        spec, sites = self.task.spec, self.task.sites
        meta = {"task": spec.to_json(), "train": asdict(self.config)}

        def write(folder: Path) -> None:
            save_file(peft_state(sites), str(folder / ADAPTER_WEIGHTS))
            config = peft_config(spec.lora, spec.model)
            (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
            (folder / TASK_FILE).write_text(json.dumps(meta, indent=2))
            torch.save(state, folder / STATE_FILE)

        step = int(state["step"])
        with writing(self.out_dir, f"the checkpoint of step {step}"):
            runs.commit_checkpoint(self.out_dir, step, write, made_by=self.made_by)


def finetune(
    spec: FinetuneSpec,
    config: TrainConfig,
    out_dir: str | Path | None = None,
    *,
    progress: bool = True,
    overwrite: bool = False,
    made_by: str = "dikkat.finetune",
) -> TrainResult:
    """Load ``spec.model``, give it adapters, and train them on ``spec.data`` (module doc)."""
    if out_dir is not None:  # refuse a folder in use before loading anything
        check_out_dir(Path(out_dir), overwrite=overwrite)
    trainer = finetuner(spec, config, out_dir, overwrite=overwrite, made_by=made_by)
    return trainer.train(progress=progress)


def finetuner(
    spec: FinetuneSpec, config: TrainConfig, out_dir: str | Path | None, **options: Any
) -> Finetuner:
    """The :class:`Finetuner` of ``spec`` (its model loaded, its data read and packed, the
    adapters added), ready to ``train()``; ``options`` go to the Trainer (``overwrite``,
    ``made_by``). A data file that is not there is refused before the model is loaded."""
    if not Path(spec.data).is_file():
        raise ValueError(f"the data {spec.data} is not a file (a JSONL file of examples)")
    lm = load(spec.model)
    lm.model.train()
    return Finetuner(FinetuneTask(spec, lm, config.seed), config, out_dir, **options)


def resume_finetune(
    out_dir: str | Path, *, steps: int | None = None, verify: bool = True
) -> Finetuner:
    """The fine-tune saved in ``out_dir``, its base model loaded again and its adapters, optimizer
    and schedule restored; ``steps`` extends it (as :func:`~dikkat.training.resume_trainer`)."""
    saved = read_checkpoint(out_dir, verify=verify)
    spec, config = _described(saved.meta, saved.folder)
    config = extended(config, int(saved.state["step"]), steps, out_dir)
    trainer = finetuner(spec, config, out_dir, made_by=saved.made_by or "dikkat.finetune",
                         _resuming=True)  # fmt: skip
    _load_adapter(trainer.task.sites, saved.folder)
    trainer.load_state(saved.state, saved.folder / STATE_FILE)
    return trainer


def load_finetuned(run_dir: str | Path, *, verify: bool = True) -> Pretrained:
    """The base model of the fine-tune in ``run_dir`` with its current adapters, in evaluation
    mode, to chat with (it decodes eagerly: the adapters are not in the compiled step)."""
    saved = read_checkpoint(run_dir, verify=verify)
    spec, _ = _described(saved.meta, saved.folder)
    lm = load(spec.model)
    sites = add_lora(lm.model, family_of(lm), spec.lora)
    _load_adapter(sites, saved.folder)
    lm.model.eval()
    lm.compile_steps = False
    return lm


def is_finetune(path: str | Path) -> bool:
    """Whether ``path`` is a fine-tune's run folder (its checkpoint holds an adapter)."""
    try:
        return (
            runs.folder_kind(path) == "run"
            and (runs.checkpoint_dir(path) / ADAPTER_CONFIG).is_file()
        )
    except (OSError, ValueError):
        return False


def _described(meta: dict[str, Any], folder: Path) -> tuple[FinetuneSpec, TrainConfig]:
    try:
        return FinetuneSpec(**meta["task"]), TrainConfig(**meta["train"])
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{folder / TASK_FILE} is not a fine-tune's description: {e}") from None


def _load_adapter(sites: list[Site], folder: Path) -> None:
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    lora_config_of(config, str(folder / ADAPTER_CONFIG))  # what dikkat cannot compute is refused
    load_peft_state(sites, load_file(str(folder / ADAPTER_WEIGHTS)), str(folder / ADAPTER_WEIGHTS))
