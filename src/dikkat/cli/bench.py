"""The ``dikkat bench`` commands: ``bench attention`` (backends side by side), ``bench cost``
(what the n × n score matrix weighs, as a table) and ``bench decode`` (a pretrained model's
prefill and decode speed against the machine's read bandwidth)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from dikkat.bench.attention import (
    BACKENDS,
    DTYPES,
    QUICK,
    AttentionBenchConfig,
    parse_mask,
    run_attention_benchmark,
    save_results,
)
from dikkat.bench.cost import DEFAULT_NS, format_cost_table
from dikkat.bench.decode import DecodeBenchConfig, format_decode_table, run_decode_benchmark
from dikkat.cli.args import positive_float, positive_int
from dikkat.cli.common import add_command, add_eager_argument, compiles, format_examples
from dikkat.core.tiled import CELLS

_ATTENTION_EXAMPLES = (
    ("--quick", "a smoke run in seconds (n = 128, 256)"),
    ("", "everything: n = 1k … 32k, fp32 and bf16"),
    ("--sizes 4096,8192 --dtypes fp32 --masks window256,documents16", ""),
    ("--backends sdpa,tiled,flex --masks causal --out runs/bench", ""),
)


_ATTENTION_NOTES = (
    "Writes attention.json, attention_time.png and attention_memory.png into --out. A "
    "combination whose\nestimated memory exceeds --max-gib (or 60 % of free memory) is "
    "skipped with a note."
)


def attention_examples(prog: str) -> str:
    """The examples of ``--help``, for the command spelled ``prog`` (benchmarks/attention.py)."""
    return (
        format_examples([(f"{prog} {flags}".strip(), what) for flags, what in _ATTENTION_EXAMPLES])
        + "\n\n"
        + _ATTENTION_NOTES
    )


def _comma_list(convert: Callable[[str], Any], what: str) -> Callable[[str], tuple[Any, ...]]:
    """argparse type: ``a,b,c`` → a tuple, each item checked by ``convert``."""

    def parse(text: str) -> tuple[Any, ...]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
        try:
            return tuple(convert(item) for item in items)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _choice(options: tuple[str, ...], what: str) -> Callable[[str], str]:
    def check(item: str) -> str:
        if item not in options:
            raise ValueError(f"unknown {what} {item!r}; choose from {', '.join(options)}")
        return item

    return check


def add_attention_arguments(parser: argparse.ArgumentParser, default_out: str | Path) -> None:
    """The flags of ``dikkat bench attention`` (and of ``benchmarks/attention.py``)."""

    def mask_name(item: str) -> str:
        parse_mask(item)
        return item

    add = parser.add_argument
    add("--sizes", type=_comma_list(positive_int, "sizes"), help="n values (default 1024,…,32768)")
    add("--dtypes", type=_comma_list(_choice(tuple(DTYPES), "dtype"), "dtypes"), help="fp32,bf16")
    add(
        "--masks",
        type=_comma_list(mask_name, "masks"),
        help="none, causal, window<W>, documents<K>, doclen<L> "
        "(default none,causal,window256,doclen1024)",
    )
    add(
        "--backends",
        type=_comma_list(_choice(BACKENDS, "backend"), "backends"),
        help=f"default all: {','.join(BACKENDS)} (flex only if registered)",
    )
    add("--quick", action="store_true", help="a tiny smoke run: n = 128,256, fp32, no flex")
    add("--min-time", type=positive_float, help="seconds of timed calls per row (default 0.3)")
    add("--max-gib", type=positive_float, default=8.0, help="memory budget per call (default 8)")
    add("--reference-max-n", type=positive_int, help="largest n for the reference (default 4096)")
    add("--heads", type=positive_int, help="H (default 8)")
    add("--head-dim", type=positive_int, help="D (default 64)")
    add("--threads", type=positive_int, help="torch threads (default: torch's)")
    add("--no-plots", action="store_true", help="write the JSON only")
    add("--out", type=Path, default=Path(default_out), help=f"folder (default {default_out})")


def attention_config(args: argparse.Namespace) -> Any:
    """The :class:`AttentionBenchConfig` the parsed flags ask for."""

    base = QUICK if args.quick else AttentionBenchConfig()
    given = {
        "sizes": args.sizes,
        "dtypes": args.dtypes,
        "masks": args.masks,
        "backends": args.backends,
        "min_time": args.min_time,
        "reference_max_n": args.reference_max_n,
        "H": args.heads,
        "D": args.head_dim,
        "max_bytes": int(args.max_gib * 2**30),
    }
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    values.update({name: value for name, value in given.items() if value is not None})
    return AttentionBenchConfig(**values)


def run_attention(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the flags describe, print it, write its files; returns the results."""

    config = attention_config(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run_attention_benchmark(config)
    for path in save_results(result, args.out, plots=not args.no_plots):
        print(f"wrote {path}")
    return result


def _cmd_attention(args: argparse.Namespace) -> int:
    run_attention(args)
    return 0


def _cmd_cost(args: argparse.Namespace) -> int:

    print(format_cost_table(tuple(args.n), args.heads, args.head_dim, args.batch, args.tile_cells))
    return 0


_DECODE_EXAMPLES = (
    ("dikkat bench decode smollm2", "decode and prefill tok/s, bytes/token, bandwidth share"),
    ("dikkat bench decode smollm2 --weights int8 --threads 1 --json", "one JSON object"),
)

_DECODE_NOTES = (
    "Progress goes to stderr, the report (or --json's object) to stdout. Decoding ignores EOS:\n"
    "every decode is --new-tokens long. The figures of a shared machine are noisy; compare runs\n"
    'made one after the other (docs/models.md, "Measuring speed").'
)


def _at_least_two(text: str) -> int:
    """argparse type of --new-tokens: decode speed is timed over the tokens after the first."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"expected at least 2 (decoding is timed over the tokens after the first), got {value}"
        )
    return value


def _cmd_decode(args: argparse.Namespace) -> int:
    config = DecodeBenchConfig(
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        prefill_tokens=args.prefill_tokens,
        threads=args.threads,
        weights=args.weights,
        repeat=args.repeat,
        probe_bytes=args.probe_mib * 2**20,
        compile=compiles(args),
    )

    def progress(line: str) -> None:
        print(f"dikkat: {line}", file=sys.stderr, flush=True)

    result = run_decode_benchmark(args.model, config, progress)
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_decode_table(result))
    return 0


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``dikkat bench decode``."""
    add = parser.add_argument
    add("model", metavar="MODEL", help="a name (smollm2, gemma3-270m), a .gguf file or HF folder")
    add("--prompt-tokens", type=positive_int, default=16, help="prompt of each decode (16)")
    add("--new-tokens", type=_at_least_two, default=128, help="tokens each decode makes (128)")
    add("--prefill-tokens", type=positive_int, default=512, help="prompt of the prefill (512)")
    add("--threads", type=positive_int, default=2, help="torch threads (2)")
    add(
        "--weights",
        default=None,
        help="format of the linear layers: fp32, bf16, int8, w8a8, q8, q4 (default: the "
        "model's own: a GGUF file's quantisation, kept packed)",
    )
    add_eager_argument(parser)
    add("--repeat", type=positive_int, default=3, help="timed repetitions after a warm-up (3)")
    add("--probe-mib", type=positive_int, default=1024, help="bandwidth buffer, MiB (1024)")
    add("--json", action="store_true", help="print one JSON object instead of the table")


def add_commands(sub: Any) -> None:
    """Register ``bench attention``, ``bench cost`` and ``bench decode``."""

    bench = add_command(
        sub,
        "bench",
        lambda args: bench.print_help() or 0,
        help="measure attention backends; the cost of the score matrix; a model's decode speed",
        description="Benchmarks: `bench attention` times every attention backend side by side, "
        "`bench cost` tabulates what the n × n score matrix weighs, `bench decode` measures a "
        "pretrained model's prefill and decode speed against the read bandwidth.",
        examples=[("dikkat bench attention --quick", "backends side by side, in seconds")],
    )
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    attention = add_command(
        commands,
        "attention",
        _cmd_attention,
        help="forward time and peak memory of every backend against n",
        description="Attention backends side by side (reference, SDPA, tiled, auto, linear, "
        "flex) over masks none / causal / sliding window / packed documents, fp32 and bf16, "
        "B=1, H=8, D=64: a table, JSON, and plots of time and peak memory against n.",
        examples=[
            (f"dikkat bench attention {flags}".strip(), what) for flags, what in _ATTENTION_EXAMPLES
        ],
        notes=_ATTENTION_NOTES,
    )
    add_attention_arguments(attention, default_out="runs/bench")

    cost = add_command(
        commands,
        "cost",
        _cmd_cost,
        help="score cells and bytes of attention against n",
        description="For each n: the n² score cells per head, their bytes in fp32 and bf16 per "
        "head and for all heads, the bytes of q, k, v, and what tiled attention holds instead.",
        examples=[
            ("dikkat bench cost", "n = 1k, 4k, 32k, 128k; B=1, H=8, D=64"),
            ("dikkat bench cost --n 2048 65536 --heads 12 --head-dim 128", ""),
        ],
    )
    cost.add_argument("--n", type=positive_int, nargs="+", default=list(DEFAULT_NS))
    cost.add_argument("--heads", type=positive_int, default=8, help="H (default 8)")
    cost.add_argument("--head-dim", type=positive_int, default=64, help="D (default 64)")
    cost.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    cost.add_argument(
        "--tile-cells", type=positive_int, default=CELLS, help="score cells of a tiled tile"
    )

    decode = add_command(
        commands,
        "decode",
        _cmd_decode,
        help="prefill and decode tok/s of a pretrained model, and its share of read bandwidth",
        description="llama.cpp's llama-bench in dikkat's words: a greedy decode of --new-tokens "
        "from a random --prompt-tokens prompt (EOS ignored) and a prefill of --prefill-tokens, "
        "after one warm-up, --repeat times; the bytes a decoded token reads (weights and KV "
        "cache), the read bandwidth measured in the same run, the share of it decoding reaches, "
        "and the peak resident memory.",
        examples=list(_DECODE_EXAMPLES),
        notes=_DECODE_NOTES,
    )
    add_decode_arguments(decode)
