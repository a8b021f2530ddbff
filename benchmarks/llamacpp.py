"""dikkat and llama.cpp side by side on the same GGUF files: speed, greedy tokens, perplexity.

    python benchmarks/llamacpp.py [--models smollm2,gemma3-270m] [--rounds 3] [--threads 2]
                                  [--quick] [--dikkat-cmd CMD] [--out DIR]

llama.cpp is the copy vendored by the llama-cpp-python sdist, built once into a cache outside
the checkout (benchmarks/llamacpp_build.py). For each model:

- speed: ``llama-bench -p 512 -n 128 -r 1`` and ``dikkat bench decode --prefill-tokens 512
  --new-tokens 128 --repeat 1`` (each on the file's own packed weights) in ``--rounds``
  interleaved rounds whose order alternates, so that the load of a shared machine falls on
  both; each figure is the median of its rounds; dikkat's JSON gives the read bandwidth too.
- greedy tokens and perplexity (benchmarks/llamacpp_quality.py): how many of ``--greedy`` greedy
  tokens agree, and ``llama-perplexity -c 512`` beside dikkat's by the same method on held-out
  standard-library source.

Writes ``llamacpp.json`` (every raw figure) and ``llamacpp.md`` (the tables) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

from common import RESULTS
from dikkat.bench.record import save_json
from dikkat.files import atomic_write
from llamacpp_build import VERSION, LlamaCppError, build_llamacpp, cache_dir, run
from llamacpp_quality import compare, heldout_text, quality_table

EXAMPLES = """examples:
  python benchmarks/llamacpp.py --quick
      smollm2 only, one round, a short text (builds llama.cpp first if need be)
  python benchmarks/llamacpp.py
      smollm2 and gemma3-270m, 3 rounds, ~24 KB of held-out text
  python benchmarks/llamacpp.py --models gemma3-270m --rounds 5 --skip greedy,perplexity
  python benchmarks/llamacpp.py --dikkat-cmd "python my_decode_bench.py"
      any command taking dikkat bench decode's arguments and printing its JSON
  python benchmarks/llamacpp.py --before ../old/src --skip quality
      this tree and an older one (a git worktree's src) side by side, with llama.cpp"""
KEYS = ("decode_tok_s", "prefill_tok_s")


def parse_llama_bench(stdout: str, prefill: int, new: int) -> dict[str, float]:
    """llama-bench's ``-o json`` → {"prefill_tok_s", "decode_tok_s"} (its pp and tg tests)."""
    found = {}
    for t in json.loads(stdout):
        if t["n_prompt"] == prefill and t["n_gen"] == 0:
            found["prefill_tok_s"] = float(t["avg_ts"])
        elif t["n_prompt"] == 0 and t["n_gen"] == new:
            found["decode_tok_s"] = float(t["avg_ts"])
    if len(found) != 2:
        raise LlamaCppError(f"llama-bench gave no pp{prefill} and tg{new}: {stdout[:200]!r}")
    return found


def parse_dikkat_json(stdout: str) -> dict:
    """The JSON object ``dikkat bench decode --json`` prints: its last line that is one, or the
    whole output printed with indentation."""
    found = None
    for line in reversed(stdout.strip().splitlines()):
        try:
            found = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            continue
        if found is not None:
            break
    if found is None:
        try:
            found = json.loads(stdout)
        except json.JSONDecodeError:
            raise LlamaCppError(f"dikkat printed no JSON object: {stdout[-200:]!r}") from None
    missing = [k for k in KEYS if k not in found]
    if missing:
        raise LlamaCppError(f"dikkat bench decode's JSON has no {missing}")
    return found


def one(value: float | list[float]) -> float:
    """A figure, or the median of a list of them (dikkat's JSON has one per repetition)."""
    return statistics.median(value) if isinstance(value, list) else float(value)


def speed_rounds(bins: Path, dikkat_cmd: list[str], path: Path, args) -> dict[str, list[dict]]:
    """``args.rounds`` interleaved rounds of the engines on one file (llama.cpp, dikkat, and
    with ``--before`` dikkat from another tree), the order alternating."""
    sizes = {"threads": args.threads, "prefill-tokens": args.prefill, "new-tokens": args.new}
    llama = [str(bins / "llama-bench"), "-m", str(path), "-t", str(args.threads)]
    llama += ["-p", str(args.prefill), "-n", str(args.new), "-r", "1", "-o", "json"]
    ours = [*dikkat_cmd, str(path)]
    for flag, value in {**sizes, "prompt-tokens": args.prompt, "repeat": 1}.items():
        ours += [f"--{flag}", str(value)]
    ours += ["--json", *(["--weights", args.weights] if args.weights else [])]
    ours += ["--eager"] if args.eager else []
    commands = {"dikkat": ours}
    if args.before:  # the same command, importing dikkat from the other tree
        commands["dikkat before"] = ["env", f"PYTHONPATH={args.before}", *ours]
    runs: dict[str, list[dict]] = {"llama.cpp": [], **{e: [] for e in commands}}
    for r in range(args.rounds):
        for engine in list(runs)[:: 1 if r % 2 == 0 else -1]:
            if engine == "llama.cpp":
                out = run(llama, f"llama-bench on {path.name}").stdout
                runs[engine].append(parse_llama_bench(out, args.prefill, args.new))
            else:
                out = run(commands[engine], f"{engine} on {path.name}").stdout
                runs[engine].append(parse_dikkat_json(out))
            d, p = (one(runs[engine][-1][k]) for k in KEYS)
            print(f"  round {r + 1} {engine:>9}: decode {d:7.1f} tok/s, prefill {p:7.1f} tok/s")
    return runs


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per engine, the median over rounds of decode and prefill tok/s."""
    return {
        e: {k: statistics.median(one(r[k]) for r in rs) for k in KEYS} for e, rs in runs.items()
    }


def speed_table(per_model: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: one row per model and engine, dikkat's rows with their ratio to llama.cpp."""
    lines = [
        "| model | engine | decode tok/s | prefill tok/s | decode dikkat/llama.cpp "
        "| prefill dikkat/llama.cpp |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model, m in per_model.items():
        for engine in m:
            d, p = (m[engine][k] for k in KEYS)
            ratios = [f"{m[engine][k] / m['llama.cpp'][k]:.2f}" for k in KEYS]
            ratios = ratios if engine != "llama.cpp" else ["", ""]
            lines.append(f"| {model} | {engine} | {d:.1f} | {p:.1f} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--models", default="smollm2,gemma3-270m", help="names or .gguf files, comma-separated")
    add("--rounds", type=int, default=3, help="interleaved speed rounds")
    add("--threads", type=int, default=2)
    add("--prefill", type=int, default=512, help="prefill tokens timed")
    add("--new", type=int, default=128, help="decoded tokens timed")
    add("--prompt", type=int, default=16, help="prompt tokens before decoding")
    add("--weights", default=None, help="dikkat's weight format (default: the file's, packed)")
    add(
        "--eager",
        action="store_true",
        help="dikkat decodes step by step in Python, not through its compiled step (dikkat bench "
        "decode --eager)",
    )
    add("--greedy", type=int, default=64, help="greedy tokens compared")
    add("--ctx", type=int, default=512, help="perplexity chunk length (llama-perplexity -c)")
    add("--text-bytes", type=int, default=24_000, help="held-out text, characters")
    add("--quick", action="store_true", help="the first model, one round, 8 KB of text")
    add("--skip", default="", help="parts left out, comma-separated: speed, quality")
    add("--llamacpp-version", default=VERSION, help="the llama-cpp-python sdist's version")
    add("--cache", type=Path, default=cache_dir(), help="where llama.cpp is built")
    add("--dikkat-cmd", help="the command before MODEL (default: python -m dikkat bench decode)")
    add("--before", type=Path, help="another tree's src: its dikkat runs too, 'dikkat before'")
    add("--out", type=Path, default=RESULTS / "llamacpp")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.rounds = args.models.split(",")[0], 1
        args.text_bytes = min(args.text_bytes, 8_000)
    for name in ("rounds", "threads", "prefill", "new", "prompt", "greedy", "ctx", "text_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if set(filter(None, args.skip.split(","))) - {"speed", "quality"}:
        parser.error(f"--skip takes speed and quality, got {args.skip!r}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        return run_all(args)
    except LlamaCppError as e:
        raise SystemExit(f"llamacpp.py: {e}") from None


def run_all(args: argparse.Namespace) -> dict:
    from dikkat.pretrained.sources import resolve

    torch.set_num_threads(args.threads)
    default = [sys.executable, "-m", "dikkat", "bench", "decode"]
    dikkat_cmd = shlex.split(args.dikkat_cmd) if args.dikkat_cmd else default
    skip = args.skip.split(",")
    bins = build_llamacpp(args.cache, args.llamacpp_version)
    text = heldout_text(args.text_bytes)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "models": {}}
    speeds, quality, gb_s = {}, {}, []
    for name in args.models.split(","):
        path = resolve(name).path
        print(f"{name}: {path}", flush=True)
        r = results["models"][name] = {"file": str(path)}
        if "speed" not in skip:
            r["speed_rounds"] = speed_rounds(bins, dikkat_cmd, path, args)
            speeds[name] = r["speed"] = medians(r["speed_rounds"])
            gb_s += [x["read_gb_s"] for x in r["speed_rounds"]["dikkat"] if "read_gb_s" in x]
        if "quality" not in skip:
            quality[name] = compare(bins, path, args.greedy, text, args.ctx, args.threads)
            r.update(quality[name])
    tables = []
    if speeds:
        bw = f"; read bandwidth {statistics.median(gb_s):.1f} GB/s" if gb_s else ""
        tables.append(
            f"Speed, median of {args.rounds} rounds, {args.threads} threads, prefill "
            f"{args.prefill}, decode {args.new}{bw}:\n\n{speed_table(speeds)}"
        )
    if quality:
        tables.append(
            f"Greedy ({args.greedy} tokens) and perplexity (-c {args.ctx}, {len(text)} "
            f"characters of standard-library source):\n\n{quality_table(quality)}"
        )
    report = "\n\n".join(tables) + "\n"
    print("\n" + report)
    args.out.mkdir(parents=True, exist_ok=True)
    written = save_json(args.out / "llamacpp.json", {**results, "report": report})
    atomic_write(args.out / "llamacpp.md", lambda tmp: Path(tmp).write_text(report))
    print(f"wrote {written} and {written.with_suffix('.md')}")
    return results


if __name__ == "__main__":
    main()
