"""Parts of a decode step, each in PyTorch and in dikkat's own code.

    python benchmarks/decode_parts.py [--rounds 200] [--threads 2] [--filled 80]
                                      [--slots 144,1024] [--product-rounds 15]
                                      [--model smollm2] [--skip PARTS]

(a) **The greedy pick**: ``logits.argmax(-1)`` of one row of fp32 logits, for the vocabularies
of SmolLM2 (49 152), GPT-2 (50 257) and Gemma 3 (262 144), against
:func:`dikkat.generation.sampler.largest` (the native ``argmax_rows``).

(b) **One row's attention in a static cache**: GPT-2-small's 12 layers of 12 heads of 64, the
cache (1, 12, S, 64) per layer for each S of ``--slots``, its first ``--filled`` slots filled.
"masked": what the static step compiles for a batch (``_attend`` in
:mod:`dikkat.models.static_step`: broadcast products over every slot, the unfilled masked),
through ``torch.compile``; "native": the kernel the step calls for one row
(``paged_attention``, the cache read in place, only the filled slots), in a compiled function
too. Both take the same query and cache; their outputs are compared.

(c) **The fp32 products of a step**: GPT-2-small's 49 weight matrices of one step (per layer
q/k/v 2304 × 768, output 768 × 768, MLP 3072 × 768 and 768 × 3072) and its 50 257 × 768 head,
random fp32 weights (498 MB, more than the caches hold), times 1 and 2 rows: ``F.linear``
(PyTorch's CPU product), oneDNN's (the weights reordered for it, as
:class:`dikkat.weights.dense.Fp32Linear` does for many rows) and the native ``linear_rows``.
A call is one pass over all 50 matrices; ``--product-rounds`` rounds; medians in milliseconds,
and the read bandwidth that makes.

(d) **The compiled step's calls from Python or from C++**: :class:`dikkat.models.StaticStep`'s
step for ``--model`` (a name or a GGUF file; batch 1, a 16-token prompt), compiled with
inductor's Python wrapper and with its C++ one (``cpp_wrapper``, what the static step uses on
the CPU), each step one token, ``--product-rounds`` rounds of 30 steps; medians in ms per step.

Each pair is timed in interleaved calls (one of each per round, so that the machine's load falls
on both alike), ``--rounds`` rounds; the medians are reported, in microseconds. ``--skip`` leaves
parts out (a comma-separated list of pick, attention, products, wrapper).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import machine, save_json
from dikkat.generation.sampler import largest
from dikkat.kernels import linear_rows_op, paged_attention_op, qmm_op
from dikkat.models import static_step
from dikkat.models.static_step import _attend
from dikkat.weights.inference import inference_model

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


def products(rows: int, rounds: int) -> dict[str, float]:
    C, g = 768, torch.Generator().manual_seed(rows)
    shapes = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)] * LAYERS + [(50_257, C)]
    weights = [torch.randn(n, k, generator=g) for n, k in shapes]
    biases = [torch.randn(n, generator=g) for n, _ in shapes]
    xs = {k: torch.randn(rows, k, generator=g) for k in (C, 4 * C)}
    op = linear_rows_op()

    def each(product: Callable[[torch.Tensor, int], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for i, w in enumerate(weights):
                product(xs[w.shape[1]], i)

        return run

    fns = {
        "torch": each(lambda x, i: F.linear(x, weights[i], biases[i])),
        "native": each(lambda x, i: op(x, weights[i], biases[i])),
    }
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        fns["onednn"] = each(
            lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i], biases[i], "none", [], "")
        )
    times = {name: t / 1e3 for name, t in medians(fns, rounds).items()}  # ms
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {**times, "gb_s": {name: nbytes / t / 1e6 for name, t in times.items()}}


def wrapper(model_name: str, rounds: int) -> dict[str, float]:
    from dikkat.pretrained import load

    model = inference_model(load(model_name).model)
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(torch.arange(100, 116)[None], cache=cache)
    paged_attention_op()  # looked up outside the compiled region, as the steps do
    keys, values = [c.k for c in cache], [c.v for c in cache]
    layout = model.cache_layout()
    windows = tuple(layout.window(i) for i in range(layout.n_layers))
    outside = static_step._outside_the_model
    steps = {}
    for name, options in (("python", {}), ("c++", {"cpp_wrapper": True})):
        code = static_step._step.__code__.replace()  # each its own graphs
        fn = types.FunctionType(code, static_step._step.__globals__, "_step")
        build = {"guard_filter_fn": outside, "cpp_wrapper_build_separate": True, **options}
        steps[name] = torch.compile(fn, options=build)

    def thirty(step: Callable[..., torch.Tensor]) -> Callable[[], None]:
        @torch.no_grad()
        def run() -> None:
            token = torch.tensor([100])
            for slot in range(16, 46):
                token = largest(step(model, windows, keys, values, token, torch.tensor(slot)))

        return run

    return {name: t / 30e3 for name, t in medians(
        {name: thirty(step) for name, step in steps.items()}, rounds).items()}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--filled", type=int, default=80, help="filled slots of each cache")
    parser.add_argument("--slots", default="144,1024", help="cache lengths, comma-separated")
    parser.add_argument("--product-rounds", type=int, default=15, help="rounds of (c) and (d)")
    parser.add_argument("--model", default="smollm2", help="the model of (d)")
    parser.add_argument(
        "--skip", default="", help="parts left out: pick,attention,products,wrapper"
    )
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - {"pick", "attention", "products", "wrapper"}:
        parser.error(f"--skip takes pick, attention, products, wrapper; got {args.skip!r}")
    sizes = [int(s) for s in args.slots.split(",")]
    if args.rounds < 1 or args.product_rounds < 1 or not 1 <= args.filled <= min(sizes):
        parser.error("--rounds, --product-rounds must be at least 1, --filled in 1 … the "
                     "smallest of --slots")  # fmt: skip
    if qmm_op() is None:
        raise SystemExit("decode_parts.py: dikkat's native kernels could not be built here")
    torch.set_num_threads(args.threads)
    results: dict = {}
    if "pick" not in skip:
        picks = {name: greedy_pick(vocab, args.rounds) for name, vocab in VOCABULARIES.items()}
        results["greedy_pick_us"] = picks
        print(f"greedy pick of one row, median µs over {args.rounds} rounds:")
        for name, t in picks.items():
            print(f"  {name:8} torch {t['torch']:7.1f}   native {t['native']:6.1f}")
    if "attention" not in skip:
        results["attention_us"] = {}
        print(f"one row's attention, {LAYERS} layers, {args.filled} slots filled:")
        for slots in sizes:
            t = results["attention_us"][slots] = attention(slots, args.filled, args.rounds)
            print(f"  S={slots:5}  masked {t['masked']:7.1f}   native {t['native']:7.1f}"
                  f"   max |Δ| {t['max_abs_diff']:.1e}")  # fmt: skip
    if "products" not in skip:
        results["products_ms"] = {}
        print(f"GPT-2-small's fp32 products of a step, median ms (GB/s) over "
              f"{args.product_rounds} rounds:")  # fmt: skip
        for rows in (1, 2):
            t = results["products_ms"][rows] = products(rows, args.product_rounds)
            shown = [f"{k} {t[k]:6.2f} ({t['gb_s'][k]:4.1f})" for k in ("torch", "onednn", "native")
                     if k in t]  # fmt: skip
            print(f"  {rows} row{'s' if rows > 1 else ' '}  " + "   ".join(shown))
    if "wrapper" not in skip:
        t = results["wrapper_ms"] = wrapper(args.model, args.product_rounds)
        print(f"{args.model}'s compiled step, ms per step, median over {args.product_rounds} "
              f"rounds of 30: Python wrapper {t['python']:.2f}, "
              f"C++ wrapper {t['c++']:.2f}")  # fmt: skip
    path = save_json("decode_parts", {"args": vars(args), "machine": machine(), **results})
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
