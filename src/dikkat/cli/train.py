"""The training commands of ``dikkat``: ``train`` and ``translate`` (the demos: :mod:`.demo`).

``dikkat train``'s tasks, their recipes (the defaults of the flags left out) and which size
flags apply to which come from the task registry (:mod:`dikkat.tasks`): a new task needs no
change here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dikkat import runs
from dikkat.cli.args import add_no_verify, non_negative_float, positive_float, positive_int
from dikkat.cli.common import add_command, add_device, device_of
from dikkat.cli.folders import held, load_model, refusal
from dikkat.cli.launch import add_parallel, die_with_launcher, launch, parallel_of, under_launcher
from dikkat.models.seq2seq import Seq2Seq
from dikkat.tasks import TaskSpec, build_task, task_info, task_names
from dikkat.tasks.translate import encode_numbers
from dikkat.text import load_tokenizer
from dikkat.text.number_words import BOS_ID, EOS_ID, NumberTokenizer

if TYPE_CHECKING:
    from dikkat.training.results import TrainResult
    from dikkat.training.trainer import Trainer

DEFAULT_TASK = "lm"  # --task left out of a new run
SIZE_FLAGS = ("d_model", "layers", "heads", "kv_heads", "position", "dropout")


def with_recipe(args: argparse.Namespace) -> argparse.Namespace:
    """Parsed ``dikkat train`` arguments with the task (DEFAULT_TASK if left out) and every flag
    left out (None) set to that task's recipe (:meth:`dikkat.tasks.TaskInfo.training`)."""
    filled = {**vars(args), "task": args.task or DEFAULT_TASK}
    for name, value in task_info(filled["task"]).training().items():
        if filled.get(name) is None:
            filled[name] = value
    return argparse.Namespace(**filled)


def _model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    fields = task_info(args.task).size_flags
    out: dict[str, Any] = {}
    for flag in SIZE_FLAGS:
        value = getattr(args, flag)
        if value is None:
            continue
        if flag not in fields:
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to --task {args.task}")
        targets = fields[flag]
        for name in targets if isinstance(targets, tuple) else (targets,):
            out[name] = value
    return out


def _summary(result: Any, task: str) -> None:
    print(
        f"\nsteps {result.steps}   train loss {result.train_loss:.3f}   "
        f"validation loss {result.val_loss:.3f} {result.unit}"
    )
    for name, value in result.metrics.items():
        print(f"{name}: {value:.4f}")
    print(f"{result.seconds:.0f} s, {result.tokens_per_second:,.0f} tokens/s")
    summary = task_info(task).summary
    line = None if summary is None else summary(result.metrics, result.seconds)
    if line:
        print(line)
    if result.out_dir is not None:
        print(f"checkpoint, log.jsonl and loss.png in {result.out_dir}")


def _check_resumable(out: Path, task: str | None) -> None:
    """Refuse, in one line, ``--resume`` of a saved model, or of a run of another task than
    ``--task`` names. (A folder with no run at all is refused by resume_trainer.)"""
    if runs.folder_kind(out) not in ("run", "model"):
        return
    what = held(out)
    if not what.is_run:
        raise ValueError(refusal(what, "a training run (--resume continues one)"))
    if task is not None and what.task is not None and what.task != task:
        raise ValueError(
            f"{out} holds {what.describe()}, not a {task!r} run: --resume continues the run's "
            f"own task (leave out --task, or give --task {what.task})"
        )


def run_training(trainer: Trainer, progress: bool) -> TrainResult | int:
    """``trainer.train()``; a run folder that could not be written (a full disk) ends in one
    line and exit status 1, as does a signal in every rank but rank 0, which says it."""
    from dikkat.training.results import SaveError  # training loads when a command runs
    from dikkat.training.signals import TrainingInterrupted

    try:
        return trainer.train(progress=progress)
    except SaveError as e:
        print(f"dikkat: error: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        if trainer.ranks.main:
            raise
        return 128 + e.signum


def cmd_train(args: argparse.Namespace) -> int:
    # training loads when a command runs, not when `dikkat --help` builds the parsers
    from dikkat.training.checkpoint import check_out_dir, hold_out_dir
    from dikkat.training.parallel import release
    from dikkat.training.trainer import TrainConfig, Trainer, resume_trainer

    where: dict[str, Any] = {"device": device_of(args), "parallel": parallel_of(args)}
    out = Path(args.out or f"runs/{args.task or DEFAULT_TASK}")
    launching = args.nproc > 1 and not under_launcher()
    die_with_launcher()  # a rank of `dikkat train --nproc` never outlives it
    if args.resume:
        if args.overwrite:
            raise ValueError("--resume continues the run in --out; --overwrite would replace it")
        _check_resumable(out, args.task)
    elif launching:  # refuse what can be refused here, in one line, not once per process
        check_out_dir(out, overwrite=args.overwrite, what="--out")
        if with_recipe(args).batch_size % args.nproc:
            raise ValueError(f"--batch-size is not a multiple of --nproc {args.nproc}")
    if launching:  # the launcher holds the run for its ranks (rank 0 finds it held for it)
        lock = hold_out_dir(out, "--out")
        try:
            return launch(args.nproc, args.argv)
        finally:
            lock.release()
    if args.resume:
        trainer = resume_trainer(out, steps=args.steps, verify=not args.no_verify, **where)
        if trainer.ranks.main:
            print(f"resuming {out} at step {trainer.step} of {trainer.config.steps}")
    else:
        check_out_dir(out, overwrite=args.overwrite, what="--out")  # before any slow work
        args = with_recipe(args)
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
        trainer = Trainer(
            task, config, out, overwrite=args.overwrite, made_by="dikkat train", **where
        )
        n = sum(p.numel() for p in task.model.parameters())
        if trainer.ranks.main:
            print(
                f"{spec.task}: {type(task.model).__name__} '{spec.preset}' with {n:,} parameters, "
                f"{config.steps} steps of {config.batch_size}, {type(task.tokenizer).__name__}"
            )
    result = run_training(trainer, not args.no_progress)
    if isinstance(result, int):
        return result
    ranks = trainer.ranks
    if ranks.main:
        _summary(result, trainer.task.spec.task)
    del trainer  # and with it the DDP wrapper, which must go before the process group (release)
    release(ranks)
    return 0


def cmd_translate(args: argparse.Namespace) -> int:

    verify, device = not args.no_verify, device_of(args)
    model = load_model(Seq2Seq, args.checkpoint, "translate", verify=verify, device=device).eval()
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


def _recipe_line(name: str) -> str:
    r = task_info(name).training()
    return (
        f"  {name:<10} {task_info(name).help}\n"
        f"  {'':<10} preset {r['preset']}, {r['steps']} steps of {r['batch_size']}, "
        f"lr {r['lr']:g}, warmup {r['warmup']}, evaluated every {r['eval_every']}"
    )


def add_commands(sub: Any) -> None:
    """Register train and translate."""
    names = task_names()
    train = add_command(
        sub,
        "train",
        cmd_train,
        help="train a model on built-in data: " + ", ".join(names),
        description="Train a model on built-in data (no download): the Python standard library's "
        "sources for lm/mlm (or --data FILE|FOLDER), generated number pairs for translate, "
        "scikit-learn's digits, generated shapes. A progress bar shows loss, tokens/s and ETA; "
        "the run folder gets the checkpoint, a JSON-lines log and loss.png. Ctrl-C and SIGTERM "
        "save; --resume continues exactly.",
        examples=[
            ("dikkat train --task lm --out runs/gpt", "a GPT on the standard library"),
            ("dikkat train --task lm --tokenizer bpe --vocab-size 2048 --d-model 192", ""),
            ("dikkat train --task translate --out runs/translate", "digits → English words"),
            ("dikkat train --task digits --out runs/digits", "then: dikkat vit-attention"),
            ("dikkat train --task shapes --out runs/shapes", "then: dikkat detect"),
            ("dikkat train --out runs/gpt --resume --steps 4000", "continue, exactly"),
        ],
        notes="tasks and their recipes (the defaults of the flags left out):\n"
        + "\n".join(_recipe_line(n) for n in names),
    )
    train.add_argument(
        "--task", choices=names, help=f"what to learn (default {DEFAULT_TASK}; --resume: the run's)"
    )
    train.add_argument("--preset", help="model preset (default: the task's recipe)")
    size = train.add_argument_group("model size (override the preset; not every task has all)")
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
    opt = train.add_argument_group("optimization (defaults: the task's recipe, listed below)")
    opt.add_argument(
        "--steps", type=positive_int, help="total steps (with --resume: extend the run to)"
    )
    opt.add_argument("--batch-size", type=positive_int)
    opt.add_argument("--lr", type=positive_float, help="peak learning rate")
    opt.add_argument("--warmup", type=int, help="warmup steps")
    opt.add_argument("--bf16", action="store_true", help="bf16 autocast")
    opt.add_argument("--eval-every", type=int, help="steps between validation losses")
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
    add_device(train)
    add_parallel(train)
    add_no_verify(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    tr = add_command(
        sub,
        "translate",
        cmd_translate,
        help="numbers in digits → English words, with a trained translator",
        description="Translate whole numbers (0–999,999) to English words with a run of "
        "`dikkat train --task translate`.",
        examples=[("dikkat translate runs/translate 4721 90210 1,000", "")],
    )
    tr.add_argument("checkpoint")
    tr.add_argument("numbers", nargs="+")
    add_device(tr)
    add_no_verify(tr)
