"""Two versions of dikkat side by side: the tiled backend's time in alternated processes.

    python benchmarks/versions.py OLD/src NEW/src [--rounds 8] [--calls 7]

A restructuring must not slow the kernels down, but on a shared machine two runs of the same code
differ by more than the change to be measured. So each round starts one process per version
(alternating which goes first), each process times every configuration (fastest of ``--calls``
after a warm-up, wall clock and process CPU time), and the table compares the medians over the
rounds. ``OLD/src`` is e.g. a ``git worktree add /tmp/old <commit>`` checkout's ``src``.
Not part of ``make bench``: it needs a second source tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# B = 1, H = 8, D = 64, fp32, forward: one plan of rows and both kinds of windows plans
CONFIGS = (
    "causal@4096",
    "window256@4096",
    "window256@16384",
    "doclen1024@4096",
    "doclen1024@16384",
)

# runs in the child process, against whichever dikkat its PYTHONPATH holds
CHILD = """
import json, sys, time
import torch
import dikkat
from dikkat import masks

def mask_of(name, n):
    if name == "causal":
        return masks.causal()
    if name.startswith("window"):
        return masks.sliding_window(int(name[6:]))
    return masks.causal() & masks.document(torch.arange(n) // int(name[6:]))

calls = int(sys.argv[1])
torch.manual_seed(0)
out = {}
for config in sys.argv[2:]:
    name, n = config.split("@")
    n = int(n)
    q, k, v = (torch.randn(1, 8, n, 64) for _ in range(3))
    m = mask_of(name, n)
    with torch.no_grad():
        dikkat.attention(q, k, v, m, backend="tiled")  # warm-up: plan and tile masks
        wall = cpu = float("inf")
        for _ in range(calls):
            w0, c0 = time.perf_counter(), time.process_time()
            dikkat.attention(q, k, v, m, backend="tiled")
            wall = min(wall, time.perf_counter() - w0)
            cpu = min(cpu, time.process_time() - c0)
    out[config] = (wall * 1e3, cpu * 1e3)
print(json.dumps(out))
"""


def run_one(src: Path, calls: int, configs: list[str]) -> dict[str, tuple[float, float]]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(calls), *configs],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", type=Path, help="the old version's src folder")
    parser.add_argument("new", type=Path, help="the new version's src folder")
    parser.add_argument("--rounds", type=int, default=8, help="processes per version")
    parser.add_argument("--calls", type=int, default=7, help="timed calls per configuration")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="mask@n, comma-separated")
    args = parser.parse_args(argv)
    for src in (args.old, args.new):
        if not (src / "dikkat" / "__init__.py").is_file():
            parser.error(f"{src} holds no dikkat package (give a checkout's src folder)")
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be at least 1")
    configs = args.configs.split(",")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for which in order:
            runs[which].append(run_one(getattr(args, which), args.calls, configs))
    print(f"tiled, fp32, B 1, H 8, D 64: medians over {args.rounds} alternated processes")
    print(f"{'config':<18}{'old ms':>9}{'new ms':>9}{'new/old':>9}{'CPU new/old':>13}")
    table = {}
    for c in configs:
        med = {w: [statistics.median(x[c][i] for x in runs[w]) for i in (0, 1)] for w in runs}
        wall, cpu = med["new"][0] / med["old"][0], med["new"][1] / med["old"][1]
        print(f"{c:<18}{med['old'][0]:9.1f}{med['new'][0]:9.1f}{wall:9.3f}{cpu:13.3f}")
        table[c] = {"old_ms": med["old"][0], "new_ms": med["new"][0], "wall": wall, "cpu": cpu}
    return table


if __name__ == "__main__":
    main()
