"""What loading a pretrained model costs a fresh process: memory and seconds.

    python benchmarks/load_memory.py [--models smollm2,gemma3-270m] [--rounds 3] [--before SRC]

Each round starts one process per model (and per tree, with ``--before``: another checkout's
``src`` measured the same way, the trees taking turns) that imports dikkat, loads the model
(``dikkat.pretrained.load``) and generates 16 greedy tokens. It reports the peak resident memory
over the bare ``import dikkat`` (VmHWM less VmRSS after the import), what the process holds
after the load, the load's and the generation's seconds, and whether torch's compiler
(``torch._dynamo``) was imported. Medians over rounds, with the range; writes
``benchmarks/results/load_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import machine, save_json

CHILD = """
import json, sys, time
import dikkat

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

base = status("VmRSS")
start = time.perf_counter()
import dikkat.pretrained
lm = dikkat.pretrained.load(sys.argv[1])
loaded = time.perf_counter()
held = status("VmRSS") - base
lm.generate("Hello, how are you?", max_new_tokens=16, temperature=0)
print(json.dumps({
    "peak_mib": status("VmHWM") - base, "held_mib": held, "load_s": loaded - start,
    "generate_s": time.perf_counter() - loaded, "compiler": "torch._dynamo" in sys.modules,
}))
"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another tree's src, measured beside this one")
    args = parser.parse_args(argv)
    trees = {"this tree": str(Path(__file__).resolve().parents[1] / "src")}
    if args.before:
        trees["before"] = str(args.before)
    runs: dict[str, dict[str, list[dict]]] = {}
    for r in range(args.rounds):
        for model in args.models.split(","):
            for tree in list(trees)[:: 1 if r % 2 == 0 else -1]:
                env = {**os.environ, "PYTHONPATH": trees[tree]}
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, model], capture_output=True, text=True,
                    env=env, timeout=900, check=True,
                )  # fmt: skip
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs.setdefault(model, {}).setdefault(tree, []).append(result)
                print(f"round {r + 1} {model} ({tree}): {result}", flush=True)
    print("\n| model | tree | peak MiB | held MiB | load s | generate 16 s | compiler |")
    print("|---|---|---:|---:|---:|---:|---|")
    for model, per_tree in runs.items():
        for tree, results in per_tree.items():

            def cell(key: str, digits: int, results: list[dict] = results) -> str:
                values = [r[key] for r in results]
                med = statistics.median(values)
                return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"

            compiler = "yes" if any(r["compiler"] for r in results) else "no"
            print(
                f"| {model} | {tree} | {cell('peak_mib', 0)} | {cell('held_mib', 0)} | "
                f"{cell('load_s', 2)} | {cell('generate_s', 2)} | {compiler} |"
            )
    settings = {k: str(v) for k, v in vars(args).items()}
    result = {"args": settings, "machine": machine(), "runs": runs}
    save_json("load_memory", result)
    return result


if __name__ == "__main__":
    main()
