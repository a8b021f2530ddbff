"""The demonstrations of ``dikkat``: ``leak-demo`` (the causal mask's fake loss) and ``demo``
(a small GPT learns Python, samples from its KV cache, and the leak is shown)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from dikkat import runs
from dikkat.cli.args import positive_int
from dikkat.cli.common import add_command, add_device, device_of
from dikkat.cli.train import run_training
from dikkat.tasks import TaskSpec, build_task

DEMO = "dikkat demo"  # who made the demo's run (run.json): the demo replaces only its own


def print_leak(result: Any) -> None:
    print(
        f"\n{'':<30}{'train loss':>12}{'causal val loss':>17}"
        f"   (nats/byte, {result.steps} steps each)"
    )
    for run in (result.masked, result.unmasked):
        print(f"{run.name:<30}{run.train_loss:>12.3f}{run.causal_val_loss:>17.3f}")
    print("samples (greedy, KV cache):")
    for run in (result.masked, result.unmasked):
        print(f"  {run.name:<28} {run.sample[:70]!r}")
    m, u = result.masked, result.unmasked
    ratio = m.train_loss / max(u.train_loss, 1e-9)
    worse = u.causal_val_loss - m.causal_val_loss
    print(
        f"Without the mask the training loss is {ratio:.0f}× lower — and fake: evaluated causally "
        f"it is {worse:+.2f} nats/byte worse than the honest model (docs/contract.md §5)."
    )


def cmd_leak_demo(args: argparse.Namespace) -> int:
    from dikkat.training.leak import leak_demo  # training loads when a command runs

    print("The same tiny GPT, the same batches, trained with and without the causal mask.")
    result = leak_demo(
        steps=args.steps,
        data=args.data,
        seed=args.seed,
        progress=not args.no_progress,
        device=device_of(args),
    )
    print_leak(result)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a small GPT on the standard library, show the leak, sample with the KV cache."""
    # training loads when a command runs, not when `dikkat --help` builds the parsers
    from dikkat.training.checkpoint import check_out_dir
    from dikkat.training.leak import leak_demo
    from dikkat.training.trainer import TrainConfig, Trainer

    t0 = time.perf_counter()
    device = device_of(args)
    out = Path(args.out)
    # an earlier demo's run is the demo's to replace; anything else only with --overwrite
    replace = runs.folder_kind(out) == "run" and runs.made_by(out) == DEMO
    if not replace:
        check_out_dir(out, overwrite=args.overwrite, what="--out")
    spec = TaskSpec(
        task="lm",
        preset="tiny",
        seq_len=args.seq_len,
        model_overrides={"position": "rope", "max_len": args.seq_len},
    )
    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=2e-3,
        warmup=min(100, args.steps // 10),
        eval_every=max(args.steps // 8, 1),
        bf16=args.bf16,
    )
    print("1. A small GPT learns Python from this interpreter's own standard library.")
    task = build_task(spec)
    n = sum(p.numel() for p in task.model.parameters())
    print(
        f"   {n:,} parameters, bytes as tokens, "
        f"{config.steps} steps of {config.batch_size}×{spec.seq_len} tokens"
    )
    overwrite = replace or args.overwrite
    trainer = Trainer(task, config, out, overwrite=overwrite, made_by=DEMO, device=device)
    result = run_training(trainer, not args.no_progress)
    if isinstance(result, int):
        return result
    print(
        f"   validation loss {result.val_loss:.3f} nats/byte after {result.seconds:.0f} s "
        f"({result.tokens_per_second:,.0f} tokens/s); uniform guessing would be {5.545:.3f}"
    )

    print(
        "\n2. Its continuation of 'def ' — one prefill, then one token at a time from the KV cache:"
    )
    tokenizer = task.tokenizer
    prompt = tokenizer.encode("def ")
    room = task.model.config.max_len - len(prompt)  # the KV cache holds at most the context
    ids = task.model.generate(
        [prompt], min(args.sample_tokens, room), temperature=0.7, top_k=20, seed=0
    )[0]
    print("   " + tokenizer.decode(ids).replace("\n", "\n   "))

    print(
        "\n3. A fake loss (docs/contract.md §5): the same kind of model trained without the "
        "causal mask."
    )
    leak = leak_demo(steps=args.leak_steps, seed=0, progress=not args.no_progress, device=device)
    print_leak(leak)

    print(f"\nDone in {time.perf_counter() - t0:.0f} s. Checkpoint, log.jsonl and loss.png: {out}/")
    print(f"Continue the text yourself:  dikkat generate {out} 'import ' -n 200 --temperature 0.8")
    print(f"As a GGUF file llama.cpp runs:  dikkat export {out} --gguf {out}.gguf")
    print("Every number of docs/contract.md, computed:  dikkat seeds")
    return 0


def add_commands(sub: Any) -> None:
    """Register leak-demo and demo."""
    leak = add_command(
        sub,
        "leak-demo",
        cmd_leak_demo,
        help="train a GPT with and without the causal mask",
        description="Train the same tiny GPT twice, with and without the causal mask: the "
        "unmasked one reaches a far lower training loss that is fake — evaluated causally, or "
        "asked to generate, it is worse (docs/contract.md).",
        examples=[("dikkat leak-demo --steps 300", "")],
    )
    leak.add_argument("--steps", type=positive_int, default=300)
    leak.add_argument("--data", help="text file or folder (default: the Python standard library)")
    leak.add_argument("--seed", type=int, default=0)
    add_device(leak)
    leak.add_argument("--no-progress", action="store_true")

    demo = add_command(
        sub,
        "demo",
        cmd_demo,
        help="watch a GPT learn Python, sample from it, see the leak (≈ 4 min)",
        description="Train a small GPT on the standard library's sources with a progress bar, "
        "sample from it with the KV cache, run the leak demo, leave a checkpoint and a loss plot.",
        examples=[
            ("dikkat demo", "what `make demo` runs"),
            ("dikkat demo --steps 200 --out runs/quick", ""),
        ],
    )
    demo.add_argument("--steps", type=positive_int, default=700)
    demo.add_argument("--batch-size", type=positive_int, default=16)
    demo.add_argument("--seq-len", type=positive_int, default=256)
    demo.add_argument("--leak-steps", type=positive_int, default=300)
    demo.add_argument("--sample-tokens", type=positive_int, default=200)
    demo.add_argument("--bf16", action="store_true")
    add_device(demo)
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a run or model in --out that is not a demo's",
    )
    demo.add_argument("--no-progress", action="store_true")
