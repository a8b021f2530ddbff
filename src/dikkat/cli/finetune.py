"""``dikkat finetune``: LoRA adapters on a pretrained model, trained on a JSONL file
(:mod:`dikkat.training.finetune`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dikkat.cli.args import add_no_verify, non_negative_float, positive_float, positive_int
from dikkat.cli.common import add_command
from dikkat.cli.train import run_training

# the recipe of a LoRA fine-tune: PEFT's and TRL's usual settings for a small model
DEFAULTS = {"steps": 200, "batch_size": 4, "lr": 2e-4, "warmup": 10, "eval_every": 50}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cmd_finetune(args: argparse.Namespace) -> int:
    # training loads when the command runs, not when `dikkat --help` builds the parsers
    from dikkat.training.checkpoint import check_out_dir
    from dikkat.training.config import TrainConfig, native_bf16
    from dikkat.training.finetune import FinetuneSpec, finetuner, resume_finetune
    from dikkat.training.lora import LoraConfig

    out = Path(args.out)
    if args.resume:
        if args.overwrite:
            raise ValueError("--resume continues the run in --out; --overwrite would replace it")
        trainer = resume_finetune(out, steps=args.steps, verify=not args.no_verify)
        print(f"resuming {out} at step {trainer.step} of {trainer.config.steps}")
    else:
        if args.model is None or args.data is None:
            raise ValueError("a new fine-tune needs --model and --data (or --resume)")
        check_out_dir(out, overwrite=args.overwrite, what="--out")  # before any slow work
        targets = ALL_LINEAR if args.targets == ["all-linear"] else tuple(args.targets)
        spec = FinetuneSpec(
            # a path as an absolute one, so that --resume and `dikkat chat RUN` find it from
            # any folder; a name (smollm2, a hub id) as given
            model=str(Path(args.model).resolve()) if Path(args.model).exists() else args.model,
            data=str(Path(args.data).resolve()),
            seq_len=args.seq_len,
            eval_fraction=args.eval_fraction,
            checkpointing=args.checkpointing,
            lora=LoraConfig(args.rank, args.alpha, args.lora_dropout, targets, args.seed),
        )
        config = TrainConfig(
            steps=args.steps or DEFAULTS["steps"],
            batch_size=args.batch_size,
            lr=args.lr,
            warmup=args.warmup,
            weight_decay=0.0,
            bf16=native_bf16() if args.bf16 is None else args.bf16,
            eval_every=args.eval_every,
            eval_batches=1,
            log_every=args.log_every,
            save_every=args.save_every,
            seed=args.seed,
        )
        trainer = finetuner(spec, config, out, overwrite=args.overwrite, made_by="dikkat finetune")
        _describe(trainer)
    result = run_training(trainer, not args.no_progress)
    if isinstance(result, int):
        return result
    print(
        f"\nsteps {result.steps}   train loss {result.train_loss:.3f}   "
        f"held-out loss {result.val_loss:.3f} {result.unit}"
    )
    print(f"{result.seconds:.0f} s, {result.tokens_per_second:,.0f} tokens/s")
    print(f"the adapter (PEFT's format), log.jsonl and loss.png in {out}; "
          f"dikkat chat {out} talks to it")  # fmt: skip
    return 0


def _describe(trainer: Any) -> None:
    task = trainer.task
    train, held = task.rows["train"], task.rows["val"]
    n = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    c = trainer.config
    print(
        f"{task.spec.model}: {len(task.sites)} adapters ({', '.join(task.spec.lora.targets)}; "
        f"rank {task.spec.lora.rank}), {n:,} trained parameters"
    )
    held_rows = 0 if held is None else held.ids.shape[0]
    precision = "bf16 autocast" if c.bf16 else "fp32"
    print(
        f"data: {train.ids.shape[0]} rows of {task.spec.seq_len} tokens to train on, "
        f"{held_rows} held out; {c.steps} steps of {c.batch_size}, {precision}"
    )


def add_commands(sub: Any) -> None:
    """Register finetune."""
    p = add_command(
        sub,
        "finetune",
        cmd_finetune,
        help="train LoRA adapters on a pretrained model (a GGUF file's weights stay packed)",
        description="Fine-tune a pretrained model with LoRA adapters on a JSONL file: each line "
        'is {"messages": [...]} (chat, rendered in the model\'s own template, the loss on the '
        'assistant\'s turns), {"text": ...} or {"prompt": ..., "completion": ...}. Examples '
        "are packed into rows with a document mask. The run folder gets the adapter in PEFT's "
        "format, a JSON-lines log and loss.png; Ctrl-C saves, --resume continues exactly. "
        "docs/finetune.md has the details.",
        examples=[
            ("dikkat finetune --model smollm2 --data chats.jsonl --out runs/ft", ""),
            ("dikkat finetune --out runs/ft --resume --steps 400", "continue, exactly"),
        ],
        notes="then: dikkat chat runs/ft (talk to the result), dikkat export runs/ft --gguf "
        "ft.gguf (the merged model, for llama.cpp) or --lora-gguf ft-lora.gguf (llama.cpp's "
        "adapter file)",
    )
    p.add_argument("--model", help="a name, GGUF file or HF folder (dikkat models lists them)")
    p.add_argument("--data", help="a JSONL file of examples")
    p.add_argument("--out", default="runs/finetune", help="run folder (default runs/finetune)")
    lora = p.add_argument_group("adapters")
    lora.add_argument("--rank", type=positive_int, default=8)
    lora.add_argument("--alpha", type=positive_float, default=16.0, help="scale: alpha / rank")
    lora.add_argument("--lora-dropout", type=non_negative_float, default=0.0)
    lora.add_argument(
        "--targets",
        nargs="+",
        default=["q_proj", "v_proj"],
        help="modules by their transformers names (default q_proj v_proj), or all-linear",
    )
    data = p.add_argument_group("data")
    data.add_argument("--seq-len", type=positive_int, default=512, help="tokens a packed row")
    data.add_argument(
        "--eval-fraction", type=non_negative_float, default=0.1, help="share held out"
    )
    opt = p.add_argument_group("optimization")
    opt.add_argument("--steps", type=positive_int, help=f"default {DEFAULTS['steps']}")
    opt.add_argument("--batch-size", type=positive_int, default=DEFAULTS["batch_size"])
    opt.add_argument("--lr", type=positive_float, default=DEFAULTS["lr"])
    opt.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    opt.add_argument("--eval-every", type=int, default=DEFAULTS["eval_every"])
    opt.add_argument("--log-every", type=positive_int, default=5)
    opt.add_argument("--save-every", type=int, default=0, help="0: at the end")
    opt.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        help="bf16 autocast (default: on where the CPU has AVX512-BF16 and no AMX)",
    )
    opt.add_argument(
        "--checkpointing", action="store_true", help="recompute activations (less memory)"
    )
    opt.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    add_no_verify(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
