"""Prompt-lookup decoding against plain greedy decoding, completing Python code: tokens/s, the
guesses accepted, tokens per model call, and the tokens themselves (asserted identical).

    python benchmarks/speculative.py [--run DIR] [--steps 500] [--k 4,8] [--new 96]

The model must have learned code for its guesses to mean anything, so the script first trains
one: the tiny byte-level GPT of ``dikkat demo`` (4 layers of width 128, RoPE) with dikkat's own
trainer on this interpreter's standard library, for ``--steps`` steps of 16 windows of
``--seq-len`` bytes (``dikkat demo`` trains 700), saved as a run in ``--run``. A ``--run`` that
already holds a run is reused as it is. The prompts are ``--prompts`` stretches of ``--prompt``
bytes, each cut at a line end, from the standard-library files the split held out of training;
each is completed by ``--new`` greedy tokens, plain (one model call a token) and by prompt
lookup with each ``--k``, inside one ``packed_for_inference`` block (the weights prepared once).
The times are the best of ``--repeats`` passes over all prompts, after a warm-up, on
``--threads`` threads (training uses torch's default).
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
from dikkat.generation import LookupStats, generate, lookup_generate, packed_for_inference
from dikkat.models import GPT
from dikkat.tasks import TaskSpec, build_task
from dikkat.tasks.corpus import load_corpus
from dikkat.training.checkpoint import TASK_FILE
from dikkat.training.trainer import TrainConfig, Trainer


def trained_run(run: Path, steps: int, seq_len: int) -> tuple[GPT, TaskSpec, dict]:
    """The run in ``run``, trained first (``steps`` steps) when the folder holds none."""
    if runs.folder_kind(run) == "run":
        meta = json.loads((runs.checkpoint_dir(run) / TASK_FILE).read_text())
        spec = TaskSpec(**meta["task"])
        step = runs.read_pointer(run)["step"]
        print(f"reusing the run in {run} (trained {step} steps)")
        return GPT.load(run).eval(), spec, {"reused": str(run), "steps": step}
    spec = TaskSpec(
        task="lm",
        preset="tiny",
        seq_len=seq_len,
        model_overrides={"position": "rope", "max_len": seq_len},
    )
    config = TrainConfig(
        steps=steps, batch_size=16, lr=2e-3, warmup=min(100, steps // 10), eval_every=0
    )
    task = build_task(spec)
    result = Trainer(task, config, run, made_by="benchmarks/speculative.py").train()
    print(
        f"trained {steps} steps in {result.seconds:.0f} s: validation loss "
        f"{result.val_loss:.3f} nats/byte (uniform guessing: 5.545)"
    )
    trained = {"steps": steps, "seconds": result.seconds, "val_loss": result.val_loss}
    return task.model.eval(), spec, trained  # type: ignore[return-value]


def code_prompts(spec: TaskSpec, count: int, length: int) -> list[list[int]]:
    """``count`` stretches of held-out standard-library code, ``length`` bytes or fewer, each
    starting at a line start and ending at a line end, spread evenly over the held-out text."""
    val = load_corpus(spec.data, seed=spec.seed, max_bytes=spec.max_bytes).val.encode("utf-8")
    prompts = []
    for i in range(count):
        start = val.find(b"\n", i * (len(val) - length) // count) + 1
        piece = val[start : start + length]
        prompts.append(list(piece[: piece.rfind(b"\n") + 1]))
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
    parser.add_argument("--steps", type=int, default=500, help="training steps (a new run only)")
    parser.add_argument("--seq-len", type=int, default=256, help="training window = context")
    parser.add_argument("--k", default="4,8", help="guessed tokens per model call, a list")
    parser.add_argument("--ngram", type=int, default=3, help="longest n-gram matched")
    parser.add_argument("--prompts", type=int, default=8, help="held-out code prompts")
    parser.add_argument("--prompt", type=int, default=160, help="bytes per prompt (at most)")
    parser.add_argument("--new", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads while decoding")
    args = parser.parse_args(argv)
    model, spec, trained = trained_run(args.run, args.steps, args.seq_len)
    torch.set_num_threads(args.threads)  # a small model decodes overhead-bound: 1 is usual best
    prompts = code_prompts(spec, args.prompts, min(args.prompt, model.config.max_len - args.new))
    new = args.new * len(prompts)

    def plain() -> list[list[int]]:
        return [generate(model, [p], args.new)[0] for p in prompts]

    def lookup(k: int, stats: LookupStats | None = None) -> Callable[[], list[list[int]]]:
        return lambda: [
            lookup_generate(model, [p], args.new, k=k, ngram=args.ngram, stats=stats)[0]
            for p in prompts
        ]

    rows = []
    with torch.inference_mode(), packed_for_inference(model, "fp32"):
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
    sample = bytes(expected[0][len(prompts[0]) :]).decode("utf-8", errors="replace")
    print(f"the first completion: {sample!r}")
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
