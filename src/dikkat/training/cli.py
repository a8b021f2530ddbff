"""The training commands of ``dikkat``: ``train``, ``translate``, ``leak-demo`` and ``demo``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from dikkat.argtypes import add_no_verify, non_negative_float, positive_float, positive_int

RAW = argparse.RawDescriptionHelpFormatter
DEMO = "dikkat demo"  # who made the demo's run (run.json): the demo replaces only its own

# command-line size flags → the config field of each task's model
_SIZE_FIELDS = {
    "lm": {
        "d_model": "d_model",
        "layers": "n_layers",
        "heads": "n_heads",
        "kv_heads": "n_kv_heads",
        "position": "position",
        "dropout": "dropout",
    },
    "mlm": {"d_model": "d_model", "layers": "n_layers", "heads": "n_heads", "dropout": "dropout"},
    "translate": {
        "d_model": "d_model",
        "heads": "n_heads",
        "dropout": "dropout",
        "layers": ("n_encoder_layers", "n_decoder_layers"),
    },
    "digits": {
        "d_model": "d_model",
        "layers": "n_layers",
        "heads": "n_heads",
        "dropout": "dropout",
    },
    "shapes": {
        "d_model": "d_model",
        "layers": "n_layers",
        "heads": "n_heads",
        "dropout": "dropout",
    },
}

# `dikkat train` flags left out take these values; a task with its own recipe overrides some
_TRAIN_DEFAULTS: dict[str, Any] = {
    "preset": "tiny",
    "steps": 1000,
    "batch_size": 32,
    "lr": 1e-3,
    "warmup": 100,
    "eval_every": 100,
}


def _train_defaults(task: str) -> dict[str, Any]:
    """The defaults of ``dikkat train --task TASK`` (digits: the ViT recipe)."""
    if task == "digits":
        from dikkat.vision.digits import DIGITS_TRAINING

        return {**_TRAIN_DEFAULTS, **DIGITS_TRAINING}
    if task == "shapes":
        from dikkat.vision.shapes_task import SHAPES_TRAINING

        return {**_TRAIN_DEFAULTS, **SHAPES_TRAINING}
    return _TRAIN_DEFAULTS


def _with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every flag left out (None) set to the task's default."""
    filled = vars(args).copy()
    for name, value in _train_defaults(args.task).items():
        if filled.get(name) is None:
            filled[name] = value
    return argparse.Namespace(**filled)


def _model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    fields = _SIZE_FIELDS[args.task]
    out: dict[str, Any] = {}
    for flag in ("d_model", "layers", "heads", "kv_heads", "position", "dropout"):
        value = getattr(args, flag)
        if value is None:
            continue
        if flag not in fields:
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to --task {args.task}")
        targets = fields[flag]
        for name in targets if isinstance(targets, tuple) else (targets,):
            out[name] = value
    return out


def _summary(result: Any, trainer: Any) -> None:
    print(
        f"\nsteps {result.steps}   train loss {result.train_loss:.3f}   "
        f"validation loss {result.val_loss:.3f} {result.unit}"
    )
    for name, value in result.metrics.items():
        print(f"{name}: {value:.4f}")
    print(f"{result.seconds:.0f} s, {result.tokens_per_second:,.0f} tokens/s")
    m = result.metrics
    if "test_accuracy" in m and "nearest_neighbour_accuracy" in m:  # digits: side by side
        averaged = m.get("test_accuracy_shift_averaged")
        tta = "" if averaged is None else f" ({averaged:.1%} averaged over 1-pixel shifts)"
        print(
            f"held-out accuracy {m['test_accuracy']:.1%}{tta} after {result.seconds:.0f} s of "
            f"training; 1-nearest-neighbour on the same split: "
            f"{m['nearest_neighbour_accuracy']:.1%}"
        )
    if result.out_dir is not None:
        print(f"checkpoint, log.jsonl and loss.png in {result.out_dir}")


def cmd_train(args: argparse.Namespace) -> int:
    from dikkat.training.checkpoint import check_out_dir
    from dikkat.training.tasks import TaskSpec, build_task
    from dikkat.training.trainer import TrainConfig, Trainer, resume_trainer

    out = Path(args.out or f"runs/{args.task}")
    if args.resume:
        if args.overwrite:
            raise ValueError("--resume continues the run in --out; --overwrite would replace it")
        trainer = resume_trainer(out, steps=args.steps, verify=not args.no_verify)
        print(f"resuming {out} at step {trainer.step} of {trainer.config.steps}")
    else:
        check_out_dir(out, overwrite=args.overwrite, what="--out")  # before any slow work
        args = _with_defaults(args)
        spec = TaskSpec(
            task=args.task,
            preset=args.preset,
            model_overrides=_model_overrides(args),
            data=args.data,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            seq_len=args.seq_len,
            max_bytes=args.max_bytes,
            seed=args.seed,
        )
        config = TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup=args.warmup,
            bf16=args.bf16,
            eval_every=args.eval_every,
            save_every=args.save_every,
            seed=args.seed,
        )
        task = build_task(spec)
        trainer = Trainer(task, config, out, overwrite=args.overwrite, made_by="dikkat train")
        n = sum(p.numel() for p in task.model.parameters())
        print(
            f"{spec.task}: {type(task.model).__name__} '{spec.preset}' with {n:,} parameters, "
            f"{config.steps} steps of {config.batch_size}, {type(task.tokenizer).__name__}"
        )
    result = trainer.train(progress=not args.no_progress)
    _summary(result, trainer)
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    from dikkat.models.seq2seq import Seq2Seq
    from dikkat.text import load_tokenizer
    from dikkat.training.numbers import BOS_ID, EOS_ID, NumberTokenizer, encode_numbers

    model = Seq2Seq.load(args.checkpoint, verify=not args.no_verify).eval()
    tokenizer = load_tokenizer(args.checkpoint, verify=not args.no_verify)
    if not isinstance(tokenizer, NumberTokenizer):
        raise ValueError(
            f"{args.checkpoint} is not a numbers translator (dikkat train --task translate)"
        )
    numbers = []
    for text in args.numbers:
        cleaned = text.replace(",", "").replace("_", "")
        if not cleaned.isdigit() or int(cleaned) > 999_999:
            raise ValueError(f"{text!r} is not a whole number from 0 to 999,999")
        numbers.append(int(cleaned))
    src = encode_numbers(numbers)
    rows = [[int(t) for t in row if t != 0] for row in src]
    for n, ids in zip(numbers, model.generate(rows, 16, bos_id=BOS_ID, eos_id=EOS_ID), strict=True):
        print(f"{n:>7} → {tokenizer.decode(ids)}")
    return 0


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
        f"it is {worse:+.2f} nats/byte worse than the honest model (S5: 'sahte kayıp')."
    )


def cmd_leak_demo(args: argparse.Namespace) -> int:
    from dikkat.training.leak import leak_demo

    print("The same tiny GPT, the same batches, trained with and without the causal mask.")
    result = leak_demo(
        steps=args.steps, data=args.data, seed=args.seed, progress=not args.no_progress
    )
    print_leak(result)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a small GPT on the standard library, show the leak, sample with the KV cache."""
    from dikkat import runs
    from dikkat.training.checkpoint import check_out_dir
    from dikkat.training.leak import leak_demo
    from dikkat.training.tasks import TaskSpec, build_task
    from dikkat.training.trainer import TrainConfig, Trainer

    t0 = time.perf_counter()
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
    trainer = Trainer(task, config, out, overwrite=replace or args.overwrite, made_by=DEMO)
    result = trainer.train(progress=not args.no_progress)
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

    print("\n3. The seed's warning (S5): the same kind of model trained without the causal mask.")
    print_leak(leak_demo(steps=args.leak_steps, seed=0, progress=not args.no_progress))

    print(f"\nDone in {time.perf_counter() - t0:.0f} s. Checkpoint, log.jsonl and loss.png: {out}/")
    print(f"Continue the text yourself:  dikkat generate {out} 'import ' -n 200 --temperature 0.8")
    print("Every number in the seeds, computed:  dikkat seeds")
    return 0


def add_training_commands(sub: Any) -> None:
    """Register train, translate, leak-demo and demo on the ``dikkat`` subparsers."""
    from dikkat.training.tasks import TASKS

    train = sub.add_parser(
        "train",
        help="train GPT (lm), BERT (mlm) or the translator (translate)",
        description="Train a model on built-in data (no download): the Python standard library's "
        "sources for lm/mlm (or --data FILE|FOLDER), numbers → English words for translate. "
        "A progress bar shows loss, tokens/s and ETA; the run folder gets the checkpoint, a "
        "JSON-lines log and loss.png. Ctrl-C saves; --resume continues exactly.",
        epilog="examples:\n  dikkat train --task lm --steps 2000 --out runs/gpt\n"
        "  dikkat train --task lm --tokenizer bpe --vocab-size 2048 --d-model 192 --layers 6\n"
        "  dikkat train --task mlm --steps 1000\n"
        "  dikkat train --task translate --steps 3000 --batch-size 128\n"
        "  dikkat train --task digits --out runs/digits   (ViT; then: dikkat vit-attention "
        "runs/digits)\n"
        "  dikkat train --task shapes --out runs/shapes   (then: dikkat detect runs/shapes)\n"
        "  dikkat train --out runs/gpt --resume --steps 4000",
        formatter_class=RAW,
    )
    train.add_argument("--task", choices=TASKS, default="lm")
    train.add_argument("--preset", help="model preset (default: tiny; digits: digits)")
    size = train.add_argument_group("model size (override the preset)")
    size.add_argument("--d-model", type=positive_int)
    size.add_argument(
        "--layers", type=positive_int, help="blocks (translate: each of encoder and decoder)"
    )
    size.add_argument("--heads", type=positive_int)
    size.add_argument("--kv-heads", type=positive_int, help="grouped-query attention (lm)")
    size.add_argument("--position", choices=("learned", "rope"), help="lm only")
    size.add_argument("--dropout", type=non_negative_float)
    data = train.add_argument_group("data")
    data.add_argument("--data", help="text file or folder (default: the Python standard library)")
    data.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes")
    data.add_argument("--vocab-size", type=positive_int, default=1024, help="BPE vocabulary")
    data.add_argument("--seq-len", type=positive_int, default=256)
    data.add_argument("--max-bytes", type=positive_int, help="cap on the training text")
    opt = train.add_argument_group("optimization")
    opt.add_argument(
        "--steps",
        type=positive_int,
        help="total steps (default 1000; digits: 2250; shapes: 2000; with --resume: extend to)",
    )
    opt.add_argument("--batch-size", type=positive_int, help="default 32; digits: 128")
    opt.add_argument(
        "--lr", type=positive_float, help="peak learning rate (default 1e-3; shapes: 2e-3)"
    )
    opt.add_argument("--warmup", type=int, help="warmup steps (default 100)")
    opt.add_argument("--bf16", action="store_true", help="bf16 autocast")
    opt.add_argument("--eval-every", type=int, help="default 100; digits: 250; shapes: 500")
    opt.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end)"
    )
    opt.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", help="run folder (default runs/TASK)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out")
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run or model already in --out (without it, such a folder is refused)",
    )
    add_no_verify(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

    tr = sub.add_parser(
        "translate",
        help="numbers in digits → English words, with a trained translator",
        description="Translate whole numbers (0–999,999) to English words with a checkpoint from "
        "`dikkat train --task translate`.",
        epilog="example:\n  dikkat translate runs/translate 4721 90210 1000000-1",
        formatter_class=RAW,
    )
    tr.add_argument("checkpoint")
    tr.add_argument("numbers", nargs="+")
    add_no_verify(tr)
    tr.set_defaults(func=cmd_translate)

    leak = sub.add_parser(
        "leak-demo",
        help="train a GPT with and without the causal mask (S5)",
        description="Train the same tiny GPT twice, with and without the causal mask: the unmasked "
        "one reaches a far lower training loss that is fake — evaluated causally, or asked to "
        "generate, it is worse.",
        epilog="example:\n  dikkat leak-demo --steps 300",
        formatter_class=RAW,
    )
    leak.add_argument("--steps", type=positive_int, default=300)
    leak.add_argument("--data", help="text file or folder (default: the Python standard library)")
    leak.add_argument("--seed", type=int, default=0)
    leak.add_argument("--no-progress", action="store_true")
    leak.set_defaults(func=cmd_leak_demo)

    demo = sub.add_parser(
        "demo",
        help="watch a GPT learn Python, sample from it, see the leak (≈ 5 min)",
        description="Train a small GPT on the standard library's sources with a progress bar, "
        "sample from it with the KV cache, run the leak demo, leave a checkpoint and a loss plot.",
        epilog="example:\n  dikkat demo\n  dikkat demo --steps 200 --out runs/quick",
        formatter_class=RAW,
    )
    demo.add_argument("--steps", type=positive_int, default=700)
    demo.add_argument("--batch-size", type=positive_int, default=16)
    demo.add_argument("--seq-len", type=positive_int, default=256)
    demo.add_argument("--leak-steps", type=positive_int, default=300)
    demo.add_argument("--sample-tokens", type=positive_int, default=200)
    demo.add_argument("--bf16", action="store_true")
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a run or model in --out that is not a demo's",
    )
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(func=cmd_demo)
