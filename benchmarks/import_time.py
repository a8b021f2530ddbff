"""What ``import dikkat`` costs beyond ``import torch``, and what ``dikkat --help`` costs.

    python benchmarks/import_time.py [--repeats 11] [--src SRC]

Each repeat starts one fresh interpreter per case, in a rotating order, and times inside it from
before ``import torch`` to the end of the case: ``import torch`` alone; ``import torch; import
dikkat``; ``import torch`` then ``dikkat --help`` (``dikkat.cli.main``, its output discarded).
The table gives each case's median over the repeats and its ratio to ``import torch``; the
interpreter's own start-up is outside every figure. Modules are imported as an installed package
imports them, from bytecode caches: the children may write them (``PYTHONDONTWRITEBYTECODE`` is
dropped) and one untimed process per case runs first. ``--src`` puts another source tree first on
the path (e.g. an older checkout's ``src``) to measure it the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import save_json

CASES = ("torch", "dikkat", "help")

# runs in the child process: seconds from before `import torch` to the end of the case, and how
# many modules were then loaded
CHILD = """
import sys, time
t0 = time.perf_counter()
import torch
case = sys.argv[1]
if case == "dikkat":
    import dikkat
elif case == "help":
    import contextlib, io
    from dikkat.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["--help"])
        except SystemExit:
            pass
print(time.perf_counter() - t0, len(sys.modules))
"""


def run_case(case: str, env: dict[str, str]) -> tuple[float, int]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, case],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    seconds, modules = done.stdout.split()
    return float(seconds), int(modules)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=11, help="processes per case (11)")
    parser.add_argument("--src", type=Path, help="the source tree to import dikkat from")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # compiling every source each time is not the use
    if args.src is not None:
        if not (args.src / "dikkat" / "__init__.py").is_file():
            parser.error(f"{args.src} holds no dikkat/__init__.py: give a checkout's src folder")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.src), env.get("PYTHONPATH")]))

    for case in CASES:  # untimed: writes the bytecode caches
        run_case(case, env)
    times: dict[str, list[float]] = {case: [] for case in CASES}
    modules: dict[str, int] = {}
    for r in range(args.repeats):
        for i in range(len(CASES)):  # rotate which case goes first
            case = CASES[(r + i) % len(CASES)]
            seconds, modules[case] = run_case(case, env)
            times[case].append(seconds)

    medians = {case: statistics.median(t) for case, t in times.items()}
    print(f"median of {args.repeats} fresh processes each")
    print(f"  {'':<30}{'seconds':>9}{'× torch':>9}{'modules':>9}")
    labels = {
        "torch": "import torch",
        "dikkat": "import torch; import dikkat",
        "help": "import torch; dikkat --help",
    }
    for case in CASES:
        ratio = medians[case] / medians["torch"]
        print(f"  {labels[case]:<30}{medians[case]:>9.3f}{ratio:>9.2f}{modules[case]:>9}")
    result = {
        "repeats": args.repeats,
        "src": None if args.src is None else str(args.src),
        "seconds": medians,
        "ratio_to_torch": {case: medians[case] / medians["torch"] for case in CASES},
        "modules": modules,
    }
    save_json("import_time", result)
    return result


if __name__ == "__main__":
    main()
