"""Attention backends side by side: time against n, fp32 and bf16, no mask and causal.

    python benchmarks/attention.py [--max-n 4096]

B=1, H=8, D=64. The reference materialises the (T, S) scores; SDPA is PyTorch's fused kernel
(with a structured mask it gets the equivalent dense bool mask); tiled is dikkat's exact
tiled attention; auto is what ``dikkat.attention`` picks. Figures for BENCHMARKS.md come from
one run of this.
"""

from __future__ import annotations

import argparse

import torch

import dikkat
from common import save_json, timeit
from dikkat import masks


def flops(n: int, H: int = 8, D: int = 64, visible: float = 1.0) -> float:
    """Useful FLOPs: QKᵀ and weights·V over the visible fraction of the score cells."""
    return 4.0 * H * n * n * D * visible


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-n", type=int, default=4096)  # up to 16384
    args = parser.parse_args(argv)
    sizes = [n for n in (512, 1024, 2048, 4096, 8192, 16384) if n <= args.max_n]
    rows = []
    torch.manual_seed(0)
    print(f"{'dtype':<9}{'mask':<8}{'n':>6}  {'backend':<10}{'ms':>9}{'GFLOP/s':>9}{'vs sdpa':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for mask_name in ("none", "causal", "window256"):
            mask = {"none": None, "causal": masks.causal(), "window256": masks.sliding_window(256)}[
                mask_name
            ]
            for n in sizes:
                q, k, v = (torch.randn(1, 8, n, 64, dtype=dtype) for _ in range(3))
                times = {}
                backends = ("sdpa", "auto", "tiled") + (("reference",) if n <= 4096 else ())
                if mask_name != "window256":
                    backends += ("linear",)  # another model (elu+1 features), for its cost
                for backend in backends:
                    with torch.no_grad():
                        times[backend] = timeit(
                            lambda b=backend, q=q, k=k, v=v, m=mask: dikkat.attention(
                                q, k, v, m, backend=b
                            )
                        )
                for backend, t in times.items():
                    visible = {"none": 1.0, "causal": 0.5, "window256": min(1.0, 256 / n)}[
                        mask_name
                    ]
                    gflops = flops(n, visible=visible) / t / 1e9
                    rows.append(
                        {
                            "dtype": str(dtype),
                            "mask": mask_name,
                            "n": n,
                            "backend": backend,
                            "seconds": t,
                            "gflops": gflops,
                            "vs_sdpa": t / times["sdpa"],
                        }
                    )
                    print(
                        f"{str(dtype)[6:]:<9}{mask_name:<8}{n:>6}  {backend:<10}"
                        f"{t * 1e3:>9.2f}{gflops:>9.1f}{t / times['sdpa']:>9.2f}"
                    )
    path = save_json("attention", {"B": 1, "H": 8, "D": 64, "rows": rows})
    print(f"\nwrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
