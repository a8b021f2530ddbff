"""Training tasks: what a batch is, what the loss is, and how to judge the model.

Three families, one per model (S11):

- ``lm`` — GPT, next-token prediction over a text corpus (causal);
- ``mlm`` — BERT, masked-language modelling: 15 % of tokens chosen, of those 80 % replaced by
  a mask token, 10 % by a random token, 10 % left as they are; the loss is on the chosen ones;
- ``translate`` — Seq2Seq, numbers in digits → the same numbers in English words.

Vision tasks live beside their models: ``digits`` (:mod:`dikkat.vision.digits`) trains a ViT
on scikit-learn's 8×8 handwritten digits; ``shapes`` (:mod:`dikkat.vision.shapes_task`) trains a
DETR to find generated coloured shapes.

A task owns its tokenizer and data and builds its model from a config; it is described by a
JSON-able :class:`TaskSpec`, which a checkpoint stores so that ``--resume`` can rebuild it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.core.masks import Mask
from dikkat.text import ByteTokenizer, HFTokenizer
from dikkat.training.data import encode_corpus, load_corpus, random_windows
from dikkat.validate import check_choice, check_int

TASKS = ("lm", "mlm", "translate", "digits", "shapes")


@dataclass(frozen=True)
class TaskSpec:
    """Everything needed to rebuild a task: JSON-able, stored with each checkpoint."""

    task: str = "lm"  # one of TASKS
    preset: str = "tiny"  # the model preset
    model_overrides: dict[str, Any] = field(default_factory=dict)  # config fields to change
    data: str | None = None  # text file or folder; None = the Python standard library
    tokenizer: str = "bytes"  # bytes | bpe
    vocab_size: int = 1024  # BPE vocabulary
    seq_len: int = 256  # training window (lm, mlm)
    max_bytes: int | None = None  # cap on the training text
    seed: int = 0  # data split and model initialisation

    def __post_init__(self) -> None:
        check_choice("task", self.task, TASKS)
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


# bytes per parameter while training: fp32 weights and gradients, AdamW's two moments
TRAINING_BYTES_PER_PARAMETER = 16


def available_memory() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable, capped by a cgroup
    (container) limit; None where neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def new_model(cls: type[nn.Module], config: Any) -> nn.Module:
    """``cls(config)``, after checking on the meta device (no memory) that training it fits in
    the memory this machine has: a size that does not fit is an error naming the parameter
    count, not a crash of the allocator or a visit from the out-of-memory killer."""
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(config).parameters())
    need, have = n * TRAINING_BYTES_PER_PARAMETER, available_memory()
    if have is not None and need > have:
        raise ValueError(
            f"a {cls.__name__} of {n:,} parameters needs {need / 2**30:,.1f} GiB to train "
            f"(weights, gradients, AdamW state), more than the {have / 2**30:,.1f} GiB available; "
            "choose a smaller preset or d_model / n_layers"
        )
    return cls(config)


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


def _train_bpe(text: str, vocab_size: int) -> HFTokenizer:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    return HFTokenizer(tok)


class CorpusTask(Task):
    """Shared by ``lm`` and ``mlm``: a tokenized corpus split into train and validation ids."""

    def __init__(self, spec: TaskSpec, tokenizer: Any | None = None) -> None:
        self.spec = spec
        corpus = load_corpus(spec.data, seed=spec.seed, max_bytes=spec.max_bytes)
        if tokenizer is not None:  # a saved run's: it must be the kind the run was trained with
            expected = ByteTokenizer if spec.tokenizer == "bytes" else HFTokenizer
            if not isinstance(tokenizer, expected):
                raise ValueError(
                    f"this {spec.task} run was trained with the {spec.tokenizer!r} tokenizer, "
                    f"but its checkpoint holds a {type(tokenizer).__name__}"
                )
        else:
            tokenizer = (
                ByteTokenizer()
                if spec.tokenizer == "bytes"
                else _train_bpe(corpus.train, spec.vocab_size)
            )
        self.tokenizer = tokenizer
        self.corpus_source = corpus.source
        self.ids = {
            "train": encode_corpus(corpus.train, tokenizer),
            "val": encode_corpus(corpus.val, tokenizer),
        }
        # nats/token → nats/byte: the loss per byte of text is comparable across tokenizers
        bytes_per_token = len(corpus.val.encode("utf-8")) / max(1, self.ids["val"].numel())
        self.report_scale = 1.0 / bytes_per_token


class LMTask(CorpusTask):
    """GPT next-token prediction."""

    unit = "nats/byte"

    def __init__(
        self, spec: TaskSpec, tokenizer: Any | None = None, mask: Mask | None = None
    ) -> None:
        from dikkat.models.gpt import GPT, GPTConfig

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


class MLMTask(CorpusTask):
    """BERT masked-language modelling (15 %; 80/10/10)."""

    unit = "nats/masked token"

    def __init__(self, spec: TaskSpec, tokenizer: Any | None = None) -> None:
        from dikkat.models.bert import BERT, BERTConfig

        super().__init__(spec, tokenizer)
        self.report_scale = 1.0
        self.mask_id = self.tokenizer.vocab_size  # one extra id: [MASK]
        overrides = {"vocab_size": self.tokenizer.vocab_size + 1, **spec.model_overrides}
        config = BERTConfig.preset(spec.preset, **overrides)
        if config.max_len < spec.seq_len:
            config = BERTConfig.preset(spec.preset, **{**overrides, "max_len": spec.seq_len})
        torch.manual_seed(spec.seed)
        self.model = new_model(BERT, config)

    def batch(self, split: str, generator: torch.Generator, batch_size: int) -> dict[str, Tensor]:
        x, _ = random_windows(self.ids[split], batch_size, self.spec.seq_len, generator)
        chosen = torch.rand(x.shape, generator=generator) < 0.15
        roll = torch.rand(x.shape, generator=generator)
        random_ids = torch.randint(0, self.tokenizer.vocab_size, x.shape, generator=generator)
        inputs = torch.where(chosen & (roll < 0.8), self.mask_id, x)
        inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
        targets = x.masked_fill(~chosen, -100)  # only the chosen tokens count
        return {"x": inputs, "y": targets}

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        logits = model(batch["x"])  # (B, T, V + 1)
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), batch["y"].flatten(), ignore_index=-100
        )
        return loss, int((batch["y"] != -100).sum())

    def tokens_in(self, batch: dict[str, Tensor]) -> int:
        return batch["x"].numel()

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Loss and accuracy on masked validation tokens, beside the best context-free guesses:
        the unigram distribution's cross-entropy and always guessing the commonest token."""
        g = torch.Generator().manual_seed(1234)
        hits = total = 0
        nats = 0.0
        for _ in range(8):
            b = self.batch("val", g, 16)
            logits = model(b["x"])
            keep = b["y"] != -100
            hits += int((logits.argmax(-1)[keep] == b["y"][keep]).sum())
            nats += float(F.cross_entropy(logits[keep].float(), b["y"][keep], reduction="sum"))
            total += int(keep.sum())
        counts = torch.bincount(self.ids["train"].long(), minlength=self.tokenizer.vocab_size)
        p_train = (counts.double() + 1) / (counts.sum() + counts.numel())  # add-one smoothing
        val = self.ids["val"].long()
        return {
            "masked_loss": nats / max(total, 1),
            "unigram_loss": float(-p_train[val].log().mean()),
            "masked_accuracy": hits / max(total, 1),
            "most_common_token_accuracy": float((val == counts.argmax()).float().mean()),
        }


class TranslateTask(Task):
    """Seq2Seq: numbers in digits → English words, exact match on held-out numbers."""

    def __init__(self, spec: TaskSpec, tokenizer: Any | None = None) -> None:
        from dikkat.models.seq2seq import Seq2Seq, Seq2SeqConfig
        from dikkat.training import numbers

        self.spec = spec
        self.tokenizer = tokenizer or numbers.NumberTokenizer()
        split = numbers.make_splits(seed=spec.seed)
        self.heldout, self.val_numbers = split.heldout, split.val
        self.exclude = split.exclude  # a precomputed mask: never train on these numbers
        V = self.tokenizer.vocab_size
        overrides = {
            "src_vocab_size": V,
            "tgt_vocab_size": V,
            "max_len": 64,
            **spec.model_overrides,
        }
        torch.manual_seed(spec.seed)
        self.model = new_model(Seq2Seq, Seq2SeqConfig.preset(spec.preset, **overrides))

    def batch(self, split: str, generator: torch.Generator, batch_size: int) -> dict[str, Tensor]:
        from dikkat.training import numbers

        if split == "train":
            src, tgt = numbers.sample_batch(batch_size, generator, self.exclude)
        else:
            pick = torch.randint(0, len(self.val_numbers), (batch_size,), generator=generator)
            src, tgt = numbers.encode_pairs([self.val_numbers[i] for i in pick.tolist()])
        return {"src": src, "tgt": tgt}

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        src, tgt = batch["src"], batch["tgt"]
        # targets are right-padded: the causal mask alone keeps real tokens off the padding
        logits = model(src, tgt[:, :-1], src_valid=src != 0)
        targets = tgt[:, 1:].masked_fill(tgt[:, 1:] == 0, -100)  # no loss on padding
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return loss, int((targets != -100).sum())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        from dikkat.training import numbers

        return {"heldout_exact_match": numbers.exact_match(model, self.heldout, self.tokenizer)}


def build_task(spec: TaskSpec, tokenizer: Any | None = None) -> Task:
    """The task a spec describes (``tokenizer``: reuse a saved one instead of training/choosing)."""
    if spec.task == "lm":
        return LMTask(spec, tokenizer)
    if spec.task == "mlm":
        return MLMTask(spec, tokenizer)
    if spec.task == "digits":  # a ViT on images: the vision package owns it
        from dikkat.vision.digits import DigitsTask

        return DigitsTask(spec, tokenizer)
    if spec.task == "shapes":  # a DETR on generated images
        from dikkat.vision.shapes_task import ShapesTask

        return ShapesTask(spec, tokenizer)
    return TranslateTask(spec, tokenizer)


def perplexity(nats: float) -> float:
    return math.exp(min(nats, 50.0))
