"""C2PSA at each detector stride: time and peak memory, beside a 3×3 convolution of the same width.

    python benchmarks/vision.py [--width 256] [--imgsz 640] [--strides 32 16 8]

One image (batch 1), fp32, inference (eval mode, no grad). C2PSA(C, C) attends over the C/2
channels of its inner half with max(C/2 // 64, 1) heads; at imgsz 640 the maps are 20×20 (stride
32, where YOLO26 puts it), 40×40 and 80×80. ``reference`` is the block's default backend (the
plain formula, Ultralytics' output bit for bit; it holds the (heads, N, N) scores), ``sdpa`` is
PyTorch's fused kernel, ``tiled`` dikkat's O(N)-memory tiled attention. Peak memory is what one
call adds to the process's resident memory (benchmarks/common.peak_memory), its output included.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes

import torch

from common import peak_memory, save_json, timeit
from dikkat.vision.cost import vision_cost
from dikkat.vision.psa import C2PSA, Conv


def _return_freed_memory() -> None:
    """Make glibc hand every block of 64 KiB or more back to the system when freed, so that
    peak_memory sees each call's own allocations (by default, the threshold rises after the first
    large free and later temporaries reuse memory the process already holds, counting as 0)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: leave malloc as it is
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256, help="C2PSA channels (YOLO26n: 256)")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--strides", type=int, nargs="+", default=[32, 16, 8])
    parser.add_argument("--backends", nargs="+", default=["reference", "sdpa", "tiled"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _return_freed_memory()
    torch.manual_seed(0)
    block = C2PSA(args.width, args.width).eval()
    conv = Conv(args.width, args.width, 3).eval()
    costs = {r.stride: r for r in vision_cost(args.imgsz, block.c, strides=tuple(args.strides))}
    rows = []
    print(
        f"C2PSA({args.width}, {args.width}): attention over {block.c} channels, "
        f"{block.m[0].attn.num_heads} heads; imgsz {args.imgsz}, batch 1, fp32, "
        f"torch threads {torch.get_num_threads()}\n"
    )
    print(
        f"{'stride':>6} {'map':>7} {'tokens':>7} {'scores':>10}  {'block':<16}"
        f"{'ms':>9} {'peak MiB':>9}"
    )
    for stride in args.strides:
        side = args.imgsz // stride
        x = torch.randn(1, args.width, side, side)
        cost = costs[stride]
        runs = [(f"C2PSA {b}", b) for b in args.backends] + [("Conv 3×3", None)]
        for label, backend in runs:
            if backend is None:
                module: torch.nn.Module = conv
            else:
                module = block
                block.m[0].attn.backend = backend
            with torch.no_grad():
                seconds = timeit(lambda m=module, x=x: m(x), min_time=0.5)
                peak = peak_memory(lambda m=module, x=x: m(x))
            rows.append(
                {
                    "stride": stride,
                    "side": side,
                    "tokens": cost.tokens,
                    "score_cells": cost.score_cells,
                    "block": label,
                    "backend": backend,
                    "ms": seconds * 1e3,
                    "peak_bytes": peak,
                }
            )
            print(
                f"{stride:>6} {f'{side}×{side}':>7} {cost.tokens:>7,} {cost.score_cells:>10,}  "
                f"{label:<16}{seconds * 1e3:>9.2f} {peak / 2**20:>9.1f}"
            )
    path = save_json(
        "vision",
        {"width": args.width, "imgsz": args.imgsz, "batch": 1, "dtype": "fp32", "rows": rows},
    )
    print(f"\nsaved {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
