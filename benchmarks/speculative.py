"""Prompt-lookup decoding against plain greedy decoding, completing Python code: tokens/s, the
guesses accepted, tokens per model call, and the tokens themselves (asserted identical).

    python benchmarks/speculative.py [--run DIR] [--steps 700] [--k 4,8] [--new 96]

The model must have learned code for its guesses to mean anything, so the script first trains
one: the tiny byte-level GPT of ``dikkat demo`` (4 layers of width 128, RoPE) with dikkat's own
trainer on this interpreter's standard library, for ``--steps`` steps of 16 windows of
``--seq-len`` bytes (``dikkat demo`` trains 700), saved as a run in ``--run``. A ``--run`` that
already holds a run is reused as it is, or trained on if it stopped short of ``--steps``. The
prompts are ``--prompts`` stretches of ``--prompt`` bytes (line start to mid-line) from the
standard-library files the split held out of training; each is completed by ``--new`` greedy
tokens, plain (one model call a token) and by prompt lookup with each ``--k``, on one fp32
inference copy of the model (``inference_model``: the weights prepared once). The times are the
best of ``--repeats`` passes over all prompts, after a warm-up. Training and decoding run on
``--threads`` threads.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import save_json
from dikkat import runs
from dikkat.generation import LookupStats, generate, inference_model, lookup_generate
from dikkat.models import GPT
from dikkat.tasks import TaskSpec, build_task
from dikkat.tasks.corpus import load_corpus
from dikkat.training.checkpoint import TASK_FILE
from dikkat.training.trainer import TrainConfig, Trainer, resume_trainer


def trained_run(run: Path, steps: int, seq_len: int) -> tuple[GPT, TaskSpec, dict]:
    """The run in ``run``: trained first (to ``steps`` steps) when the folder holds none, or
    holds one stopped short of ``steps``; else reused as it is."""
    if runs.folder_kind(run) == "run":
        done = int(runs.read_pointer(run)["step"])
        if done >= steps:
            meta = json.loads((runs.checkpoint_dir(run) / TASK_FILE).read_text())
            print(f"reusing the run in {run} ({done} steps)")
            return (
                GPT.load(run).eval(),
                TaskSpec(**meta["task"]),
                {"reused": str(run), "steps": done},
            )
        trainer = resume_trainer(run, steps=steps)  # an interrupted run, or extended
    else:
        spec = TaskSpec(
            task="lm",
            preset="tiny",
            seq_len=seq_len,
            model_overrides={"position": "rope", "max_len": seq_len},
        )
        config = TrainConfig(
            steps=steps, batch_size=16, lr=2e-3, warmup=min(100, steps // 10), eval_every=0
        )
        trainer = Trainer(build_task(spec), config, run, made_by="benchmarks/speculative.py")
        done = 0
    result = trainer.train()
    print(
        f"trained steps {done} … {steps} in {result.seconds:.0f} s: validation loss "
        f"{result.val_loss:.3f} nats/byte (uniform guessing: 5.545)"
    )
    trained = {"steps": steps, "seconds": result.seconds, "val_loss": result.val_loss}
    return trainer.model.eval(), trainer.task.spec, trained  # type: ignore[return-value]


def code_prompts(spec: TaskSpec, count: int, length: int) -> list[list[int]]:
    """``count`` stretches of held-out standard-library code of ``length`` bytes, each from a line
    start to mid-line (where completion is asked for), spread evenly over the held-out text."""
    val = load_corpus(spec.data, seed=spec.seed, max_bytes=spec.max_bytes).val.encode("utf-8")
    prompts = []
    for i in range(count):
        start = val.find(b"\n", i * (len(val) - 2 * length) // count) + 1
        piece = val[start : start + length]
        while piece and piece[-1] >= 0x80:  # not inside a multi-byte character
            piece = piece[:-1]
        prompts.append(list(piece))
    return prompts


def best_time(fn: Callable[[], list[list[int]]], repeats: int) -> tuple[float, list[list[int]]]:
    """(best seconds of ``repeats`` calls, the last call's result)."""
    best, out = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=Path("runs/speculative"), help="run folder")
    parser.add_argument("--steps", type=int, default=700, help="training steps (a new run only)")
    parser.add_argument("--seq-len", type=int, default=256, help="training window = context")
    parser.add_argument("--k", default="4,8", help="guessed tokens per model call, a list")
    parser.add_argument("--ngram", type=int, default=3, help="longest n-gram matched")
    parser.add_argument("--prompts", type=int, default=8, help="held-out code prompts")
    parser.add_argument("--prompt", type=int, default=160, help="bytes per prompt (at most)")
    parser.add_argument("--new", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    # a small model decodes overhead-bound; and on a shared machine more threads than free cores
    # wait on each other (OpenMP), in training too
    torch.set_num_threads(args.threads)
    model, spec, trained = trained_run(args.run, args.steps, args.seq_len)
    prompts = code_prompts(spec, args.prompts, min(args.prompt, model.config.max_len - args.new))
    new = args.new * len(prompts)
    model = inference_model(model, "fp32")  # prepared once, used by every call below

    def plain() -> list[list[int]]:
        return [generate(model, [p], args.new)[0] for p in prompts]

    def lookup(k: int, stats: LookupStats | None = None) -> Callable[[], list[list[int]]]:
        return lambda: [
            lookup_generate(model, [p], args.new, k=k, ngram=args.ngram, stats=stats)[0]
            for p in prompts
        ]

    rows = []
    with torch.inference_mode():
        generate(model, [prompts[0]], 8)  # warm-up
        lookup(4)()
        seconds, expected = best_time(plain, args.repeats)
        rows.append({"method": "greedy", "tokens_per_s": new / seconds, "tokens_per_call": 1.0})
        for k in (int(s) for s in args.k.split(",")):
            stats = LookupStats()
            lookup(k, stats)()  # counted once; the timed passes repeat the same calls
            seconds, out = best_time(lookup(k), args.repeats)
            if out != expected:
                raise AssertionError(f"lookup k={k} did not give the greedy tokens")
            rows.append(
                {
                    "method": f"lookup k={k}",
                    "tokens_per_s": new / seconds,
                    "acceptance": stats.acceptance,
                    "tokens_per_call": stats.tokens_per_call,
                    "drafted": stats.drafted,
                    "accepted": stats.accepted,
                    "calls": stats.calls,
                }
            )
    print(
        f"{len(prompts)} held-out prompts of ≤ {args.prompt} bytes, {args.new} greedy tokens each; "
        f"ngram ≤ {args.ngram}; {torch.get_num_threads()} threads"
    )
    print("method           tokens/s   × greedy   accepted   tokens/call   identical")
    base = rows[0]["tokens_per_s"]
    for r in rows:
        accepted = f"{r['acceptance']:8.1%}" if "acceptance" in r else f"{'—':>8}"
        print(
            f"{r['method']:<14} {r['tokens_per_s']:>10.1f} {r['tokens_per_s'] / base:>10.2f} "
            f"{accepted:>10} {r['tokens_per_call']:>13.2f}   yes"
        )
    print("the completions (prompt end | new tokens), to judge whether the model writes code:")
    for prompt, out in zip(prompts, expected, strict=True):
        end, new_text = (
            bytes(t).decode("utf-8", errors="replace") for t in (prompt[-30:], out[len(prompt) :])
        )
        print(f"  {end!r:>36} | {new_text[:60]!r}")
    payload = {
        "trained": trained,
        "prompts": len(prompts),
        "prompt_bytes": args.prompt,
        "new_tokens": args.new,
        "ngram": args.ngram,
        "threads": args.threads,
        "rows": rows,
    }
    save_json("speculative", payload)
    return payload


if __name__ == "__main__":
    main()
