"""`make bench`: run every benchmark in turn; each prints a table and writes results/NAME.json.

    python benchmarks/run.py                  all of them (the attention sweep alone ≈ 30 min,
                                              the long-context one ≈ 25 min; speculative
                                              trains a small GPT first, ≈ 3 min)
    python benchmarks/run.py generation vision
    python benchmarks/NAME.py --help          one benchmark's own options

The training benchmark compares against nanoGPT only when given its checkout: run
``python benchmarks/training.py --nanogpt DIR`` yourself for that.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import attention
import checkpoint
import compiled
import distributed
import generation
import hf_long_context
import import_time
import pretrained
import speculative
import training
import vision

BENCHMARKS = {
    "attention": attention.main,
    "generation": generation.main,
    "speculative": speculative.main,
    "pretrained": pretrained.main,
    "training": training.main,
    "vision": vision.main,
    "checkpoint": checkpoint.main,
    "hf_long_context": hf_long_context.main,
    "distributed": distributed.main,
    "import_time": import_time.main,
    "compiled": compiled.main,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(BENCHMARKS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    for i, name in enumerate(args.names or BENCHMARKS):
        if i:
            print()
        BENCHMARKS[name]([])


if __name__ == "__main__":
    main()
