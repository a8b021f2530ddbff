"""The ``mlm`` task: a BERT learns masked-language modelling — 15 % of the tokens chosen, of those
80 % replaced by a mask token, 10 % by a random token, 10 % left as they are; the loss is on the
chosen ones (Devlin et al. 2019, arXiv:1810.04805)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.models.bert import BERT, BERTConfig
from dikkat.tasks.base import BLOCK_SIZES, TaskInfo, TaskSpec, new_model, register_task
from dikkat.tasks.corpus import CorpusTask, random_windows
from dikkat.validate import check_int


class MLMTask(CorpusTask):
    """BERT masked-language modelling (15 %; 80/10/10)."""

    unit = "nats/masked token"

    def __init__(self, spec: TaskSpec, tokenizer: Any | None = None) -> None:
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
        device = next(model.parameters()).device
        hits = total = 0
        nats = 0.0
        for _ in range(8):
            b = {name: t.to(device) for name, t in self.batch("val", g, 16).items()}
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


MASK = "[MASK]"  # how a hidden token is written in the text given to fill_mask


@dataclass(frozen=True)
class Filled:
    """What :func:`fill_mask` found: the text with each mask replaced by its best guess, and
    for each mask the top guesses with their probabilities."""

    text: str
    guesses: list[list[tuple[str, float]]]


@torch.no_grad()
def fill_mask(model: BERT, tokenizer: Any, text: str, *, top_k: int = 5) -> Filled:
    """Predict every ``[MASK]`` in ``text`` with a BERT trained by the ``mlm`` task.

    The task's mask token is the id one past the tokenizer's vocabulary, so the model must have
    exactly one more id than the tokenizer. Each ``[MASK]`` stands for one token.
    """
    check_int("top_k", top_k)
    if MASK not in text:
        raise ValueError(f"the text has no {MASK} to fill: {text!r}")
    mask_id = tokenizer.vocab_size
    if model.config.vocab_size != mask_id + 1:
        raise ValueError(
            f"this BERT has {model.config.vocab_size} ids; a masked-LM run of this tokenizer "
            f"({tokenizer.vocab_size} tokens) has {mask_id + 1} (its extra id is {MASK})"
        )
    pieces = text.split(MASK)
    ids: list[int] = []
    at: list[int] = []  # the positions of the masks
    for i, piece in enumerate(pieces):
        ids += tokenizer.encode(piece)
        if i < len(pieces) - 1:
            at.append(len(ids))
            ids.append(mask_id)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    logits = model(torch.tensor([ids], device=device))[0, at, :mask_id]  # no guessing [MASK]
    model.train(was)
    probs = logits.float().softmax(-1)
    top = probs.topk(min(top_k, mask_id), dim=-1)
    guesses = [
        [(tokenizer.decode([int(i)]), float(p)) for p, i in zip(ps, idx, strict=True)]
        for ps, idx in zip(top.values, top.indices, strict=True)
    ]
    filled = [int(row[0]) for row in top.indices]
    out = list(ids)
    for pos, token in zip(at, filled, strict=True):
        out[pos] = token
    return Filled(tokenizer.decode(out), guesses)


register_task(
    TaskInfo(
        name="mlm",
        build=lambda spec, tokenizer: MLMTask(spec, tokenizer),
        help="BERT, masked-language modelling on text (15 %; 80/10/10)",
        recipe={},
        size_flags=BLOCK_SIZES,
    )
)
