"""What bf16, int8 and w8a8 weights cost a trained model: validation loss and greedy tokens vs fp32.

    python benchmarks/quantized_quality.py RUN [--windows 32] [--prompts 8] [--new 125]

RUN is a trained ``lm`` run, e.g. the one ``dikkat demo`` writes (``runs/demo``). For each weight
format (an inference copy, ``inference_model(model, weights)``): the mean next-token loss over
``--windows`` consecutive validation windows of the run's sequence length (through the copy's
forward, so the lm_head multiplies in that format too; nats/byte as the run reports it), its
relative difference to fp32, and the fraction of greedy tokens equal to fp32's over ``--prompts`` ×
``--new`` generated tokens (each prompt 32 validation bytes; a token counts when it equals
fp32's at the same step, so one early divergence costs the rest of that row).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from common import save_json
from dikkat import runs
from dikkat.generation import inference_model
from dikkat.models import GPT
from dikkat.tasks import TaskSpec
from dikkat.tasks.base import build_task
from dikkat.text import load_tokenizer

FORMATS = ("fp32", "bf16", "int8", "w8a8")
PROMPT = 32


def validation_loss(model: GPT, val: torch.Tensor, seq_len: int, windows: int, scale: float):
    """Mean loss over the first ``windows`` consecutive (seq_len + 1)-token windows of ``val``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            chunk = val[w * seq_len : (w + 1) * seq_len + 1]
            if chunk.numel() < seq_len + 1:
                break
            x, y = chunk[:-1].unsqueeze(0), chunk[1:].unsqueeze(0)
            logits = model(x)  # (1, T, V)
            total += float(F.cross_entropy(logits[0].float(), y[0], reduction="sum"))
            count += y.numel()
    return total / count * scale


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a trained lm run folder (dikkat demo writes runs/demo)")
    parser.add_argument("--windows", type=int, default=32, help="validation windows")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=125, help="greedy tokens per prompt")
    args = parser.parse_args(argv)
    task_file = runs.checkpoint_dir(args.run) / "task.json"
    spec = TaskSpec(**json.loads(task_file.read_text())["task"])
    task = build_task(spec, tokenizer=load_tokenizer(args.run))
    model = GPT.load(args.run).eval()
    val = task.ids["val"].long()  # bytes may be stored as uint8
    seq = min(spec.seq_len, model.config.max_len)
    if PROMPT + args.new > model.config.max_len:
        raise ValueError(f"--new {args.new} + {PROMPT} passes the context {model.config.max_len}")
    stride = val.numel() // max(1, args.prompts)
    prompts = torch.stack([val[i * stride : i * stride + PROMPT] for i in range(args.prompts)])
    result: dict = {"run": args.run, "args": vars(args), "formats": {}}
    fp32_tokens = None
    for weights in FORMATS:
        copy = inference_model(model, weights)
        loss = validation_loss(copy, val, seq, args.windows, task.report_scale)
        with torch.inference_mode():
            new = torch.tensor(copy.generate(prompts, args.new))[:, PROMPT:]
        fp32_tokens = new if fp32_tokens is None else fp32_tokens
        result["formats"][weights] = {
            "val_loss": loss,
            "same_tokens_as_fp32": float((new == fp32_tokens).float().mean()),
        }
    base = result["formats"]["fp32"]["val_loss"]
    print(
        f"{args.run}: {args.windows} validation windows of {seq}, "
        f"{args.prompts} × {args.new} greedy tokens"
    )
    for weights, r in result["formats"].items():
        r["val_loss_rel_diff"] = r["val_loss"] / base - 1
        print(
            f"  {weights:<5} val loss {r['val_loss']:.4f} ({100 * r['val_loss_rel_diff']:+.3f} %), "
            f"greedy tokens equal to fp32: {100 * r['same_tokens_as_fp32']:.1f} %"
        )
    print(f"wrote {save_json('quantized_quality', result)}")
    return result


if __name__ == "__main__":
    main()
