"""dikkat's native kernels as each kind of x86 CPU compiles them, side by side on this one.

    python benchmarks/kernel_paths.py [--rounds 15] [--threads 1] [--paths native,avx2,plain]
                                      [--old SRC]

dikkat compiles its kernels with ``-march=native``; a CPU without AVX-512 gets their AVX2 paths,
and one without AVX2 either their plain loops. Here each path is built on this machine (the
flags of tests/native_builds.py: ``-mno-avx512f``, then also ``-mno-avx2``) and run in a process
of its own, the paths taking turns each round, on a decode step's shapes: the packed product
``qmm`` of one and of 64 rows (SmolLM2's MLP, 1536 × 576) in Q8_0, Q4_1, Q4_0 and Q6_K's
layouts, the fp32 row product ``linear_rows`` (GPT-2-small's MLP, 3072 × 768) and the greedy pick
``argmax_rows`` over SmolLM2's 49 152 logits; PyTorch's own ``F.linear`` and ``argmax`` beside
them. ``--old SRC`` adds the kernels of another tree (its ``src``, e.g. an older checkout, whose
``_command`` builds them) compiled for AVX2 ("old-avx2"). Medians in milliseconds; writes
``benchmarks/results/kernel_paths.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from common import machine, save_json

FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "plain": ("-mno-avx512f", "-mno-avx2")}

# run in a child: times one round of every case for the library in argv[1], prints JSON
CHILD = textwrap.dedent(
    """
    import json, sys, time, torch
    torch.set_num_threads(int(sys.argv[2]))
    torch.ops.load_library(sys.argv[1])
    from dikkat.weights.bits import pack
    from dikkat.weights.packed import PackedWeight
    ops = torch.ops.dikkat_native
    g = torch.Generator().manual_seed(0)

    def best(f, n):
        f()
        t = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t) / n * 1e3

    out = {}
    # name: bits, block, offsets, two-level scales
    for name, (bits, block, offsets, two) in {
        "Q8_0": (8, 32, False, False), "Q4_1": (4, 32, True, False),
        "Q4_0": (4, 32, False, False), "Q6_K": (6, 16, False, True),
    }.items():
        N, K = 1536, 576 if not two else 768
        q = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
        scale = (torch.randn(N, K // block, generator=g) * 0.01).half()
        offset = torch.randn(N, K // block, generator=g).half() if offsets else None
        units = [None, None]
        if two:
            scale = torch.randint(-128, 128, scale.shape, generator=g).to(torch.int8)
            units[0] = torch.rand(N, K // 256, generator=g).half()
        p = PackedWeight(pack(q, bits), scale, offset, 0 if offsets else 2 ** (bits - 1), bits,
                         block, name, False, *units).in_groups()
        for M in (1, 64):
            x = torch.randn(M, K, generator=g)
            f = lambda: ops.qmm(x, p.values, p.scale, p.offset, p.super_scale, p.super_offset,
                                bits, block, p.zero)
            out[f"qmm {name} {M}x{K}.{K}x{N}"] = best(f, 50 if M == 1 else 3)
    x, w = torch.randn(1, 768, generator=g), torch.randn(3072, 768, generator=g)
    out["linear_rows 1x768.768x3072"] = best(lambda: ops.linear_rows(x, w, None), 50)
    out["F.linear 1x768.768x3072 (PyTorch)"] = best(lambda: torch.nn.functional.linear(x, w), 50)
    logits = torch.randn(1, 49152, generator=g)
    out["argmax_rows 49152"] = best(lambda: ops.argmax_rows(logits), 200)
    out["argmax 49152 (PyTorch)"] = best(lambda: logits.argmax(-1), 200)
    print(json.dumps(out))
    """
)


def build(src: Path, flags: tuple[str, ...], out: Path) -> None:
    """The timed kernels of the tree at ``src`` compiled with ``flags`` after
    ``-march=native``."""
    code = textwrap.dedent(
        f"""
        import subprocess, sys
        sys.path.insert(0, {str(src)!r})
        try:
            from dikkat import kernels as k
        except ImportError:  # a tree from before dikkat.kernels
            from dikkat.core import native as k
        timed = [s for s in k._SOURCES if s.name in ("qmm.cpp", "linear.cpp", "argmax.cpp")]
        cmd = k._command({shutil.which("c++") or "c++"!r}, timed, {str(out)!r})
        at = cmd.index("-march=native") + 1
        cmd[at:at] = {list(flags)!r}
        done = subprocess.run(cmd, capture_output=True, text=True)
        sys.exit(done.stderr[-2000:] if done.returncode else 0)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=1200)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paths", default="native,avx2,plain")
    parser.add_argument("--old", type=Path, help="another tree's src, built for AVX2")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1] / "src"
    builds = {name: (here, FLAGS[name]) for name in args.paths.split(",")}
    if args.old:
        builds["old-avx2"] = (args.old, FLAGS["avx2"])
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {}
        for name, (src, flags) in builds.items():
            print(f"building {name} ({' '.join(flags) or '-march=native'})…", flush=True)
            libraries[name] = Path(tmp) / f"{name}.so"
            build(src, flags, libraries[name])
        times: dict[str, dict[str, list[float]]] = {name: {} for name in libraries}
        for r in range(args.rounds):
            order = list(libraries) if r % 2 == 0 else list(libraries)[::-1]
            for name in order:
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, str(libraries[name]), str(args.threads)],
                    capture_output=True, text=True, check=True, timeout=600,
                    env={**os.environ, "DIKKAT_NATIVE": "0", "PYTHONPATH": str(here)},
                )  # fmt: skip
                for case, ms in json.loads(done.stdout).items():
                    times[name].setdefault(case, []).append(ms)
            print(f"round {r + 1}/{args.rounds}", flush=True)
    medians = {n: {c: statistics.median(v) for c, v in t.items()} for n, t in times.items()}
    cases = list(next(iter(medians.values())))
    print("\n| case | " + " | ".join(f"{n} ms" for n in medians) + " |")
    print("|---|" + "---:|" * len(medians))
    for case in cases:
        print(f"| {case} | " + " | ".join(f"{medians[n][case]:.4f}" for n in medians) + " |")
    result = {"args": vars(args) | {"old": str(args.old)}, "machine": machine(), "ms": medians}
    save_json("kernel_paths", result)
    return result


if __name__ == "__main__":
    main()
