"""Long context in a Hugging Face model: one forward pass through eager, SDPA and dikkat.

    python benchmarks/hf_long_context.py [--sizes 4096 8192 16384 32768] [--repeats 3]
    python benchmarks/hf_long_context.py --check      logits of every implementation, T = 512

A Mistral-shaped model (``MistralForCausalLM`` from a config: 2 layers, width 512, 8 query heads
and 2 key/value heads of 64, MLP 1536, vocabulary 32000, RoPE; random weights, nothing
downloaded), fp32, batch 1, ``torch.no_grad``, in two maskings: full causal
(``sliding_window=None``) and Mistral's 4096-token sliding window. Each implementation runs as
``attn_implementation``: ``eager`` and ``sdpa`` are transformers' own (``sdpa`` receives the
window as a dense bool mask), ``dikkat`` and ``dikkat-tiled`` go through ``dikkat.hf.register``
with backend ``"auto"`` and ``"tiled"`` (docs/hf.md), and ``none`` replaces attention by zeros:
the time and memory of the rest of the model. The forward keeps only the last position's logits
(``logits_to_keep=1``, as a prefill does), so the 32000-wide head costs one row.

Every (implementation, masking, T) runs in a fresh process, so peak memories do not mix: a
warm-up forward at T = 128, one first forward at T (timed apart: dikkat's tiled backend plans
its tiles and builds their masks in it), then ``--repeats`` timed forwards, whose median is the
time reported (one from ``--one-run-from`` on). Peak memory is the rise of the process's
resident high-water mark during the first forward at T (``dikkat.bench.timing.peak_memory``),
next to the whole process's high-water mark.
Before a run the bytes it needs are predicted (:func:`predicted_bytes`); a run predicted above
``--max-gib`` or above what the machine has available is not started but recorded as
"needs ≈ X GiB", and a watchdog ends a child whose resident memory passes ``--max-gib``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from common import RESULTS, peak_memory
from dikkat.bench.record import save_json

IMPLS = ("eager", "sdpa", "dikkat", "dikkat-tiled", "none")
MASKS = ("causal", "window")
GiB = 1 << 30
# the model: a small Mistral (Llama with a sliding window); heads and head dim of a 7B model's
# attention at a width two cores can run
SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


def model_config(window: int | None, max_len: int):  # -> transformers.MistralConfig
    import transformers

    return transformers.MistralConfig(
        **SHAPE, max_position_embeddings=max_len, sliding_window=window, attention_dropout=0.0
    )


def register_all() -> None:
    """dikkat's two names, and ``none``: attention replaced by zeros, with no mask built."""
    import transformers

    import dikkat.hf

    dikkat.hf.register("dikkat")
    dikkat.hf.register("dikkat-tiled", backend="tiled")

    def zeros(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, None]:
        B, H, T = query.shape[:3]
        return query.new_zeros(B, T, H, value.shape[-1]), None  # (B, T, H, Dv)

    transformers.AttentionInterface.register("none", zeros)
    transformers.AttentionMaskInterface.register("none", lambda *args, **kwargs: None)


def build_model(impl: str, window: int | None, max_len: int):
    import transformers

    transformers.logging.set_verbosity_error()
    register_all()
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(model_config(window, max_len)).eval()
    model.set_attn_implementation(impl)
    return model


def auto_backend(masking: str, n: int, window: int) -> str:
    """The backend ``dikkat.attention``'s auto picks for one layer of this model at T = ``n``."""
    import dikkat
    from dikkat import masks

    H, G, D = (SHAPE[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    q, kv = torch.empty(1, H, n, D), torch.empty(1, G, n, D)
    mask = masks.sliding_window(window) if masking == "window" else masks.causal()
    return dikkat.explain(q, kv, kv, mask).split(" ", 1)[0]


def predicted_bytes(impl: str, masking: str, n: int, window: int) -> int:
    """What a run at T = S = ``n`` needs resident, from the tensors it holds at its peak.

    The model and its activations: parameters, ≈ 16 floats of width C and 4 of the MLP's width
    per token, and the interpreter with torch and transformers; then what the attention
    materialises per (query, key) cell, as measured at T = 4096 with ``peak_memory``:
    eager — one layer's scores and their softmax, H of each in fp32, alive together, beside the
    additive fp32 mask (1, 1, T, S) and the bool mask it is built from;
    sdpa — nothing for causal (``is_causal``); the window arrives as a dense bool mask, which
    PyTorch's CPU kernel copies into an fp32 one;
    dikkat — nothing when the tiled backend runs; where auto picks SDPA for a window, dikkat
    materialises the mask (≈ 10.5 bytes a cell at its peak: the bool mask and the integer
    differences it is computed from) and SDPA copies it into fp32.
    """
    C, inner, H = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_attention_heads"]
    kv_width = SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    layer = 2 * C * C + 2 * C * kv_width + 3 * C * inner
    params = 4 * (2 * SHAPE["vocab_size"] * C + SHAPE["num_hidden_layers"] * layer)
    model = params + 4 * n * (16 * C + 4 * inner) + 500 * 2**20
    cells = n * n
    windowed = masking == "window"
    if impl == "eager":
        return model + cells * (2 * H * 4 + 4 + 1)
    if impl == "sdpa" and windowed:
        return model + cells * (1 + 4)
    if impl == "dikkat" and windowed and auto_backend(masking, n, window) == "sdpa":
        return model + cells * (11 + 4)
    return model


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def child(impl: str, masking: str, n: int, window: int, repeats: int) -> dict:
    """One configuration, measured in this (fresh) process."""
    import dikkat.hf

    model = build_model(impl, window if masking == "window" else None, max(n, 128))
    ids = torch.randint(0, SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    times: list[float] = []
    cpu: list[float] = []

    def forward() -> torch.Tensor:
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(ids, logits_to_keep=1).logits
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        return out

    with torch.no_grad():
        model(ids[:, :128], logits_to_keep=1)  # warm-up: kernels, thread pool, first allocations
        with dikkat.hf.recording() as calls:
            peak = peak_memory(forward)
        for _ in range(repeats):
            forward()
    return {
        "first_ms": 1e3 * times[0],  # the first call at T: dikkat plans its tiles in it
        "first_cpu_ms": 1e3 * cpu[0],
        "ms": 1e3 * statistics.median(times[1:]),  # the calls after it
        "cpu_ms": 1e3 * statistics.median(cpu[1:]),  # CPU time of this process, all its threads
        "runs": len(times) - 1,
        "peak_bytes": peak,
        "process_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "backends": [[c.layer, c.backend] for c in calls],
        "why": calls[0].why if calls else None,
    }


def run_child(args: argparse.Namespace, impl: str, masking: str, n: int, repeats: int) -> dict:
    """Run one configuration in its own process, ending it if it grows past ``--max-gib``."""
    cmd = [sys.executable, __file__, "--child", impl, masking, str(n), str(repeats)]
    cmd += ["--window", str(args.window)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status, limit, watched = Path(f"/proc/{proc.pid}/status"), args.max_gib * GiB, 0
    while proc.poll() is None:
        try:
            rss = next(
                int(x.split()[1]) * 1024
                for x in status.read_text().splitlines()
                if x.startswith("VmRSS:")
            )
        except (OSError, StopIteration):
            rss = 0
        watched = max(watched, rss)
        if rss > limit:
            proc.kill()
            proc.wait()
            return {"skipped": f"ended at {rss / GiB:.1f} GiB resident (limit {args.max_gib})"}
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} {masking} T={n} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "watched_bytes": watched}


def sweep(args: argparse.Namespace) -> dict:
    results: dict = {}
    for masking in args.masks:
        for n in args.sizes:
            for impl in args.impls:
                need = predicted_bytes(impl, masking, n, args.window)
                room = min(args.max_gib * GiB, available_bytes() - 2 * GiB)
                key = f"{masking}/{n}/{impl}"
                if need > room:
                    r = {"skipped": f"needs ≈ {need / GiB:.1f} GiB, not run"}
                else:
                    repeats = 1 if n >= args.one_run_from else args.repeats
                    r = run_child(args, impl, masking, n, repeats)
                r["predicted_bytes"] = need
                results[key] = r
                print(f"  {key:<28} {describe(r)}", flush=True)
    return results


def describe(r: dict) -> str:
    if "skipped" in r:
        return r["skipped"]
    peak = "?" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
    layers = ",".join(sorted({b for _, b in r["backends"]})) or "-"
    return (
        f"{r['ms']:8.0f} ms ({r['runs']} run{'s' * (r['runs'] > 1)}, CPU {r['cpu_ms']:.0f}; "
        f"first {r['first_ms']:.0f})  peak +{peak} MiB  "
        f"process {r['process_bytes'] / 2**20:.0f} MiB  (predicted "
        f"{r['predicted_bytes'] / 2**20:.0f})  backends: {layers}"
    )


def table(args: argparse.Namespace, results: dict) -> None:
    """Markdown tables: time (wall, and this process's CPU time), peak memory, and the ratios of
    sdpa and eager to dikkat (auto) from the same run."""
    for masking in args.masks:
        cols = [i for i in args.impls]
        print(f"\n{masking}: ms wall / ms CPU (peak MiB during the forward)\n")
        print(
            "| T | " + " | ".join(cols) + " | sdpa / dikkat | sdpa / dikkat, CPU | eager / dikkat |"
        )
        print("|---:|" + "---:|" * (len(cols) + 3))
        for n in args.sizes:
            row = {i: results[f"{masking}/{n}/{i}"] for i in cols}
            cells = [cell(row[i]) for i in cols]
            ratios = [
                ratio(row, "sdpa", "ms"),
                ratio(row, "sdpa", "cpu_ms"),
                ratio(row, "eager", "ms"),
            ]
            print(f"| {n} | " + " | ".join(cells + ratios) + " |")


def cell(r: dict) -> str:
    if "skipped" in r:
        return r["skipped"]
    peak = "?" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
    runs = "" if r["runs"] > 1 else " ¹"
    return f"{r['ms']:.0f} / {r['cpu_ms']:.0f} ({peak}){runs}"


def ratio(row: dict, other: str, key: str) -> str:
    a, b = row.get(other), row.get("dikkat")
    if not a or not b or "skipped" in a or "skipped" in b:
        return "-"
    return f"{a[key] / b[key]:.2f}×"


def check(n: int = 512, window: int = 128, tol: float = 1e-4) -> dict:
    """Full logits at T = ``n`` of every implementation against eager's and sdpa's, in both
    maskings (the window shorter than T, so that it hides keys); raises SystemExit if one
    differs by more than ``tol``, or if the window changed nothing."""
    import dikkat.hf

    report: dict = {}
    ids = torch.randint(0, SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    eager = {}
    for masking, w in (("causal", None), ("window", window)):
        logits = {}
        for impl in ("eager", "sdpa", "dikkat", "dikkat-tiled"):
            model = build_model(impl, w, n)
            with torch.no_grad(), dikkat.hf.recording() as calls:
                logits[impl] = model(ids).logits
            diff = {o: (logits[impl] - logits[o]).abs().max().item() for o in logits if o != impl}
            layers = [f"{c.layer} {c.backend}" for c in calls]
            report[f"{masking}/{impl}"] = {"max_abs_diff": diff, "layers": layers}
            print(
                f"  {masking:<7}{impl:<13}"
                + "".join(f"vs {o} {d:.1e}  " for o, d in diff.items())
                + ", ".join(layers)
            )
            if any(d > tol for d in diff.values()):
                raise SystemExit(f"{impl} ({masking}) differs by more than {tol}: {diff}")
        eager[masking] = logits["eager"]
    hidden = (eager["window"] - eager["causal"]).abs().max().item()
    print(f"  the window changes eager's logits by up to {hidden:.2f}: it hides keys")
    if hidden < 100 * tol:
        raise SystemExit(f"a window of {window} at T = {n} changed the logits by only {hidden}")
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="\n".join(__doc__.splitlines()[1:4]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--masks", nargs="+", choices=MASKS, default=list(MASKS))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--window", type=int, default=4096, help="sliding window, tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards (median)")
    parser.add_argument("--one-run-from", type=int, default=16384, help="T from which one run")
    parser.add_argument("--max-gib", type=float, default=14.0, help="skip runs needing more")
    parser.add_argument("--check", action="store_true", help="compare logits at T = 512 only")
    parser.add_argument("--out", type=Path, default=RESULTS / "hf_long_context.json")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        impl, masking, n, repeats = args.child
        print(json.dumps(child(impl, masking, int(n), args.window, int(repeats))))
        return {}
    torch_threads = torch.get_num_threads()
    if args.check:
        print(f"logits at T = 512 against eager (fp32, {torch_threads} threads):")
        return {"check": check()}
    print(
        f"MistralForCausalLM {SHAPE}, fp32, batch 1, window {args.window}, {torch_threads} threads"
    )
    results = sweep(args)
    table(args, results)
    payload = {"args": {**vars(args), "out": str(args.out)}, "shape": SHAPE, "results": results}
    path = save_json(args.out, payload)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
