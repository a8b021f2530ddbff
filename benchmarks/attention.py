"""Attention backends side by side: time and peak memory against n, fp32 and bf16, four masks.

    python benchmarks/attention.py [--quick] [--sizes 1024,2048] [--masks window256] [...]

The same run as ``dikkat bench attention`` (see :mod:`dikkat.bench.attention` for what each
backend and mask is), writing attention.json and the time and memory plots into
benchmarks/results/ unless --out says otherwise. Figures for BENCHMARKS.md come from one run of
this on a quiet machine.
"""

from __future__ import annotations

import argparse

from common import RESULTS
from dikkat.cli.bench import add_attention_arguments, attention_examples, run_attention


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=attention_examples("python benchmarks/attention.py"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_attention_arguments(parser, default_out=RESULTS)
    return run_attention(parser.parse_args(argv))


if __name__ == "__main__":
    main()
