"""Two parts of a decode step besides its weights, each in PyTorch and in dikkat's native kernel.

    python benchmarks/decode_parts.py [--rounds 200] [--threads 2] [--filled 80]
                                      [--slots 144,1024]

(a) **The greedy pick**: ``logits.argmax(-1)`` of one row of fp32 logits, for the vocabularies
of SmolLM2 (49 152), GPT-2 (50 257) and Gemma 3 (262 144), against
:func:`dikkat.generation.sampling.largest` (the native ``argmax_rows``).

(b) **One row's attention in a static cache**: GPT-2-small's 12 layers of 12 heads of 64, the
cache (1, 12, S, 64) per layer for each S of ``--slots``, its first ``--filled`` slots filled.
"masked": what the static step compiles for a batch (``_attend`` in
:mod:`dikkat.models.static_step`: broadcast products over every slot, the unfilled masked),
through ``torch.compile``; "native": the kernel the step calls for one row
(``paged_attention``, the cache read in place, only the filled slots), in a compiled function
too. Both take the same query and cache; their outputs are compared.

Each pair is timed in interleaved calls (one of each per round, so that the machine's load falls
on both alike), ``--rounds`` rounds; the medians are reported, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from common import machine, save_json
from dikkat.core.native import paged_attention_op, qmm_op
from dikkat.generation.sampling import largest
from dikkat.models.static_step import _attend

VOCABULARIES = {"SmolLM2": 49_152, "GPT-2": 50_257, "Gemma 3": 262_144}
LAYERS, HEADS, HEAD_DIM = 12, 12, 64


def medians(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median µs of each function, called in turn ``rounds`` times after one warm-up call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def greedy_pick(vocab: int, rounds: int) -> dict[str, float]:
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(largest(logits), logits.argmax(-1))
    return medians({"torch": lambda: logits.argmax(-1), "native": lambda: largest(logits)}, rounds)


def attention(slots: int, filled: int, rounds: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(slots)
    keys = [torch.randn(1, HEADS, slots, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, slots, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    queries = [torch.randn(1, HEADS, 1, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    pos, columns, op = torch.tensor(filled - 1), torch.arange(slots), paged_attention_op()
    scale = HEAD_DIM**-0.5

    def masked() -> list[torch.Tensor]:
        kept = (columns <= pos).view(1, 1, 1, -1)
        return [
            _attend(q, k, v, kept, scale) for q, k, v in zip(queries, keys, values, strict=True)
        ]

    def native() -> list[torch.Tensor]:
        return [
            op(q[:, :, 0], k[0].transpose(0, 1), v[0].transpose(0, 1), columns.view(1, -1),
               pos.view(1), 0, scale)[:, :, None]
            for q, k, v in zip(queries, keys, values, strict=True)
        ]  # fmt: skip

    fns = {"masked": torch.compile(masked), "native": torch.compile(native)}
    apart = max(
        (a - b).abs().max().item() for a, b in zip(fns["masked"](), fns["native"](), strict=True)
    )
    return {**medians(fns, rounds), "max_abs_diff": apart}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--filled", type=int, default=80, help="filled slots of each cache")
    parser.add_argument("--slots", default="144,1024", help="cache lengths, comma-separated")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.slots.split(",")]
    if args.rounds < 1 or not 1 <= args.filled <= min(sizes):
        parser.error("--rounds must be at least 1, --filled in 1 … the smallest of --slots")
    if qmm_op() is None:
        raise SystemExit("decode_parts.py: dikkat's native kernels could not be built here")
    torch.set_num_threads(args.threads)
    picks = {name: greedy_pick(vocab, args.rounds) for name, vocab in VOCABULARIES.items()}
    results = {"greedy_pick_us": picks, "attention_us": {}}
    print(f"greedy pick of one row, median µs over {args.rounds} rounds:")
    for name, t in results["greedy_pick_us"].items():
        print(f"  {name:8} torch {t['torch']:7.1f}   native {t['native']:6.1f}")
    print(f"one row's attention, {LAYERS} layers, {args.filled} slots filled:")
    for slots in sizes:
        t = results["attention_us"][slots] = attention(slots, args.filled, args.rounds)
        print(f"  S={slots:5}  masked {t['masked']:7.1f}   native {t['native']:7.1f}"
              f"   max |Δ| {t['max_abs_diff']:.1e}")  # fmt: skip
    path = save_json("decode_parts", {"args": vars(args), "machine": machine(), **results})
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
