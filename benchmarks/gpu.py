"""GPU timings: dikkat's Triton kernels against SDPA's flash kernel and compiled FlexAttention.

    python benchmarks/gpu.py [--smoke] [--budget 420] [--out DIR]

Prefill, forward and forward + backward, in bf16 with B · H = 32 (B = 2, H = 16), head dims 64
and 128, n = 1k … 16k queries and keys, four masks: none, causal, a causal sliding window of 1024
keys and packed documents of 2048 tokens (causal within each). Backends: ``dikkat.attention(...,
backend="triton")``; ``F.scaled_dot_product_attention`` under
``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` (no mask or ``is_causal`` only: it takes no other
mask); ``torch.compile(flex_attention, dynamic=True)`` with a block mask per size (compiled once
per mask and head dim with dynamic shapes, so the sizes share one compile).

Decoding: one query (T = 1) against a 32k cache, B = 1, H = 32, D = 128, with 32 key/value heads
and with 8 (grouped-query): :func:`dikkat.core.triton.decode.triton_decode` against the same SDPA
and FlexAttention calls (``enable_gqa``). Decoding is bound by memory, so its bytes per second
(k and v read once) are reported too.

FLOPs count only the visible (unmasked) query-key pairs: 4 · D per pair forward (two matmuls,
QKᵀ and PV, of 2 FLOPs per multiply-add), 2.5 times that backward (five matmuls), 14 · D per pair
forward + backward, as FlashAttention-2 counts them (Dao 2023, arXiv:2307.08691, §4). A mask's
skipped blocks are therefore not credited as work done.

Timing: CUDA events around each call, after warm-up calls (which also compile), the median of a
few calls. Configurations run in order until ``--budget`` seconds have passed; the rest are
recorded as skipped. Results go to DIR/gpu.json (benchmarks/results/ by default). Without CUDA
the script says so and exits, unless ``--smoke``: one tiny size of each part, timed by the
wall clock, to check the script's logic on CPU (under Triton's interpreter, TRITON_INTERPRET=1;
the SDPA and FlexAttention parts need CUDA and are skipped).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from common import RESULTS
from dikkat.bench.record import save_json

MASKS = ("none", "causal", "window", "documents")
BACKENDS = ("triton", "sdpa", "flex")
PASSES = ("fwd", "fwd+bwd")


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    sizes: tuple[int, ...]  # n: queries = keys in prefill
    head_dims: tuple[int, ...]
    batch: int
    heads: int
    window: int  # keys of the causal sliding window
    doc_len: int  # tokens per packed document
    decode_len: int  # keys in the decoding cache
    decode_heads: int
    decode_groups: tuple[int, ...]  # key/value heads of each decoding run
    decode_dim: int
    warmup: int
    reps: int


FULL = Plan(
    sizes=(1024, 2048, 4096, 8192, 16384),
    head_dims=(64, 128),
    batch=2,
    heads=16,
    window=1024,
    doc_len=2048,
    decode_len=32768,
    decode_heads=32,
    decode_groups=(32, 8),
    decode_dim=128,
    warmup=3,
    reps=10,
)
SMOKE = Plan(
    sizes=(256,),
    head_dims=(64,),
    batch=1,
    heads=2,
    window=64,
    doc_len=128,
    decode_len=300,
    decode_heads=4,
    decode_groups=(2,),
    decode_dim=64,
    warmup=1,
    reps=1,
)


class CannotRunError(Exception):
    """A configuration that cannot run here, and why."""


def visible_pairs(kind: str, n: int, plan: Plan) -> int:
    """Query-key pairs the mask lets through, per (batch row, head), for n queries and keys."""
    if kind == "none":
        return n * n
    if kind == "causal":
        return n * (n + 1) // 2
    if kind == "window":  # query i sees min(i + 1, window) keys
        w = min(plan.window, n)
        return w * (w + 1) // 2 + (n - w) * w
    docs, rest = divmod(n, plan.doc_len)  # causal inside each document
    return docs * plan.doc_len * (plan.doc_len + 1) // 2 + rest * (rest + 1) // 2


def timer(cuda: bool, warmup: int, reps: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds per call of ``fn`` after ``warmup`` calls: CUDA events on CUDA, the
    wall clock elsewhere (the smoke run)."""

    def measure(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return measure


# --- the three prefill backends ------------------------------------------------------------------


def dikkat_call(kind: str, n: int, plan: Plan, device: str) -> Callable:
    import dikkat
    from dikkat import masks

    if "triton" not in dikkat.available_backends():
        raise CannotRunError("backend 'triton' is not registered in this dikkat")
    mask = {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(plan.window),
        "documents": masks.document(torch.arange(n, device=device) // plan.doc_len),
    }[kind]
    return lambda q, k, v: dikkat.attention(q, k, v, mask, backend="triton")


def sdpa_call(kind: str, n: int, plan: Plan, device: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device != "cuda":
        raise CannotRunError("SDPA's flash kernel needs CUDA")
    if kind not in ("none", "causal"):
        raise CannotRunError("SDPA's flash kernel takes no mask but is_causal")

    def call(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=kind == "causal", enable_gqa=k.shape[1] != q.shape[1]
            )

    return call


_flex: dict[str, Callable] = {}  # the compiled flex_attention, made on first use


def compiled_flex() -> Callable:
    if "fn" not in _flex:
        from torch.nn.attention.flex_attention import flex_attention

        # every mask, head dim and grad mode is a compile of its own: room for all of them, and an
        # error rather than a silent fall-back to eager (which builds the whole score matrix)
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        _flex["fn"] = torch.compile(flex_attention, dynamic=True)
    return _flex["fn"]


def flex_call(kind: str, n: int, plan: Plan, device: str) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    if device != "cuda":
        raise CannotRunError("compiled FlexAttention runs its Triton kernels on CUDA only here")
    doc = torch.arange(n, device=device) // plan.doc_len
    mods = {
        "causal": lambda b, h, q, kv: q >= kv,
        "window": lambda b, h, q, kv: (q >= kv) & (q - kv < plan.window),
        "documents": lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
    }
    block_mask = None
    if kind in mods:
        block_mask = create_block_mask(mods[kind], None, None, n, n, device=device)
    flex = compiled_flex()
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


CALLS = {"triton": dikkat_call, "sdpa": sdpa_call, "flex": flex_call}


# --- the runs ------------------------------------------------------------------------------------


class Run:
    """The entries measured so far, the clock against ``budget`` and how to time a call."""

    def __init__(self, plan: Plan, budget: float, device: str) -> None:
        self.plan, self.budget, self.device = plan, budget, device
        self.start = time.perf_counter()
        self.measure = timer(device == "cuda", plan.warmup, plan.reps)
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32  # no bf16 math on CPU
        self.skipped_for_budget = 0

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.budget

    def attempt(self, entry: dict, work: Callable[[], dict]) -> dict:
        """``entry`` with what ``work`` measured, or why it did not run; printed as it goes."""
        if self.over_budget():
            self.skipped_for_budget += 1
            return {**entry, "skipped": f"time budget of {self.budget:.0f} s spent"}
        try:
            entry = {**entry, **work()}
        except CannotRunError as e:
            entry = {**entry, "skipped": str(e)}
        except Exception as e:  # a failing kernel is a result here, not the end of the run
            entry = {**entry, "error": f"{type(e).__name__}: {e}"[:400]}
            if self.device == "cuda":
                torch.cuda.empty_cache()
        shown = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in entry.items()}
        print(shown, flush=True)
        return entry

    def randn(self, *shape: int, grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device, dtype=self.dtype)
        return t.requires_grad_(grad)


def prefill(run: Run) -> list[dict]:
    plan, entries = run.plan, []
    for D in plan.head_dims:
        for kind in MASKS:
            for n in plan.sizes:
                shape = (plan.batch, plan.heads, n, D)
                qkv_dout = tuple(run.randn(*shape) for _ in range(4))
                pairs = plan.batch * plan.heads * visible_pairs(kind, n, plan)
                outs: dict[str, torch.Tensor] = {}
                for backend in BACKENDS:
                    for which in PASSES:
                        entry = dict(backend=backend, mask=kind, n=n, D=D, passes=which)
                        entry["visible_pairs"] = pairs
                        work = partial(time_prefill, run, backend, which, kind, qkv_dout, outs)
                        entries.append(run.attempt(entry, work))
                entries += agreement(outs, dict(mask=kind, n=n, D=D))
    return entries


def time_prefill(
    run: Run, backend: str, which: str, kind: str, qkv_dout: tuple, outs: dict
) -> dict:
    """Time one backend's forward (keeping its output in ``outs``) or forward + backward."""
    q, k, v, dout = qkv_dout
    n, D = q.shape[2], q.shape[3]
    pairs = q.shape[0] * q.shape[1] * visible_pairs(kind, n, run.plan)
    call = CALLS[backend](kind, n, run.plan, run.device)
    if which == "fwd":
        with torch.no_grad():
            outs[backend] = call(q, k, v)
            ms = run.measure(lambda: call(q, k, v))
        return dict(ms=ms, tflops=4 * D * pairs / ms / 1e9)
    x = [t.detach().requires_grad_() for t in (q, k, v)]
    ms = run.measure(lambda: torch.autograd.grad(call(*x), x, dout))
    return dict(ms=ms, tflops=14 * D * pairs / ms / 1e9)


def agreement(outs: dict[str, torch.Tensor], where: dict) -> list[dict]:
    """How far triton's forward output is from the other backends' (a sanity check, not a test)."""
    if "triton" not in outs:
        return []
    checks = []
    for name, out in outs.items():
        if name != "triton":
            diff = (outs["triton"].float() - out.float()).abs().max().item()
            checks.append({**where, "check": f"triton vs {name}", "max_abs_diff": diff})
    return checks


def decode_call(kind: str, S: int, plan: Plan, device: str) -> Callable:
    from dikkat.core.triton.decode import triton_decode

    return lambda q, k, v: triton_decode(q, k, v, scale=q.shape[-1] ** -0.5)[0]


DECODE_CALLS = {"triton": decode_call, "sdpa": sdpa_call, "flex": flex_call}


def decode(run: Run) -> list[dict]:
    """One query against a long cache; the query is the last position, so it sees every key."""
    plan, entries = run.plan, []
    B, H, S, D = 1, plan.decode_heads, plan.decode_len, plan.decode_dim
    for G in plan.decode_groups:
        q, k, v = run.randn(B, H, 1, D), run.randn(B, G, S, D), run.randn(B, G, S, D)
        outs: dict[str, torch.Tensor] = {}
        for name in DECODE_CALLS:
            label = "triton_decode" if name == "triton" else name
            entry = dict(backend=label, T=1, S=S, H=H, G=G, D=D)
            entries.append(run.attempt(entry, partial(time_decode, run, name, (q, k, v), outs)))
        entries += agreement(outs, dict(T=1, S=S, G=G, D=D))
    return entries


def time_decode(run: Run, name: str, qkv: tuple, outs: dict) -> dict:
    q, k, v = qkv
    B, H, _, D = q.shape
    call = DECODE_CALLS[name]("none", k.shape[2], run.plan, run.device)
    with torch.no_grad():
        outs[name] = call(q, k, v)
        ms = run.measure(lambda: call(q, k, v))
    kv_bytes = 2 * k.numel() * k.element_size()  # k and v, each read once
    flops = 4 * D * B * H * k.shape[2]
    return dict(ms=ms, tflops=flops / ms / 1e9, gb_per_s=kv_bytes / ms / 1e6)


def device_info() -> dict:
    import importlib.metadata

    info = {"cuda": torch.cuda.is_available()}
    try:
        info["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        info["triton"] = None
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "sm_count": props.multi_processor_count}
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["cuda_version"] = torch.version.cuda
    return info


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="one tiny size of each part (runs on CPU too)"
    )
    parser.add_argument(
        "--budget", type=float, default=420.0, help="seconds before the rest is skipped"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("benchmarks/gpu.py: no CUDA device here, nothing to time (--smoke checks the logic)")
        return None
    if not cuda:  # triton.jit reads this when the kernels are first loaded, below
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    plan = SMOKE if args.smoke else FULL
    run = Run(plan, args.budget, "cuda" if cuda else "cpu")
    results = {
        "plan": asdict(plan),
        "device": device_info(),
        "dtype": str(run.dtype),
        "decode": decode(run),  # first: short, and what generation runs
        "prefill": prefill(run),
    }
    results["skipped_for_budget"] = run.skipped_for_budget
    results["seconds"] = math.ceil(time.perf_counter() - run.start)
    name = "gpu_smoke" if args.smoke else "gpu"
    path = save_json(args.out / f"{name}.json", results)
    print(f"wrote {path} in {results['seconds']} s")
    return results


if __name__ == "__main__":
    main()
