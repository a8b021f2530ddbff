"""What packing saves against padding in a LoRA fine-tune: the same chats packed into rows with
document masks, and one chat a row padded on the right, through the same loss and backward.

    python benchmarks/finetune_packing.py [--examples 24] [--rounds 2]

SmolLM2-135M-Instruct as ``dikkat finetune`` loads it (its GGUF's packed weights), LoRA rank 16
on every projection, fp32, rows of 512, batches of 4 rows, 2 threads; the chats are those of
``benchmarks/finetune.py`` (made there once, from this Python's own docstrings). For each layout
and round: the rows, the share of their positions that hold tokens, the seconds of forward and
backward over all rows, and the real (not padding) tokens per second.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import dikkat
from dikkat.training.finetune import FinetuneSpec, FinetuneTask
from dikkat.training.lora import LoraConfig
from dikkat.training.packing import pack, padded
from dikkat.training.sft_data import read_examples
from finetune import CACHE, TARGETS, make_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    lm = dikkat.pretrained.load("smollm2")
    data = make_data(CACHE / "finetune", lm.tokenizer, 64)[0]
    lm.model.train()
    lora = LoraConfig(rank=16, alpha=32, targets=TARGETS)
    task = FinetuneTask(FinetuneSpec("smollm2", str(data), 512, 0.0, lora=lora), lm, 0)
    examples = read_examples(data, lm)[: args.examples]
    for r in range(args.rounds):
        for name, rows in (("packed", pack(examples, 512)), ("padded", padded(examples, 512))):
            task.rows["train"] = rows
            start = time.perf_counter()
            for a in range(0, rows.ids.shape[0], 4):
                batch = task.rows_batch("train", torch.arange(a, min(a + 4, rows.ids.shape[0])))
                task.loss(lm.model, batch)[0].backward()
            seconds = time.perf_counter() - start
            real = int(rows.valid.sum())
            print(f"round {r + 1} {name}: {rows.ids.shape[0]} rows, {rows.efficiency:.0%} tokens, "
                  f"{seconds:.1f} s, {real / seconds:.0f} real tokens/s")  # fmt: skip


if __name__ == "__main__":
    warnings.simplefilter("ignore", UserWarning)  # chats cut to 512 tokens: the same in both
    main()
