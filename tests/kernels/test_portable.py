"""The packed product's AVX2 path and plain loops: the native library built for a CPU without
AVX-512 (``-mno-avx512f``: AVX2's vpmaddwd, qmm_avx2.h) and for one without AVX2 either gives
the fp64 reference's products, within fp32 rounding, and keeps a NaN or ±Inf as IEEE arithmetic
does (tests/native_nan_cases.py).

The two builds register the same ops, so the portable one runs in a process of its own, with
dikkat's native kernels turned off there (``DIKKAT_NATIVE=0``): its products are compared with
the fp64 reference computed in that process from the same PyTorch operations the tests of
tests/weights/test_packed.py use."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dikkat import kernels as native
from native_builds import LESSER, portable_build, run_with

SCRIPT = textwrap.dedent(
    """
    import ctypes, sys, torch
    torch.ops.load_library(sys.argv[1])
    path = ctypes.CDLL(sys.argv[1]).dikkat_native_qmm_path
    path.restype = ctypes.c_char_p
    print(path().decode())
    from dikkat.weights.packed import PackedWeight, dequantize, round_activations
    from dikkat.weights.bits import pack
    op = torch.ops.dikkat_native.qmm
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for bits in (4, 6, 8):
        for block in (16, 32):
            for offsets in (False, True):
                for two_level in (False, True):  # fp16 scales, or int8 times fp16 a 256
                    N, K, M = 21, 512, 3  # a group of 16 rows and 5 more; two super-blocks
                    q = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
                    scale = torch.randn(N, K // block, generator=g).half() * 0.01
                    offset = torch.randn(N, K // block, generator=g).half() if offsets else None
                    units = [None, None]
                    if two_level:
                        scale = torch.randint(-128, 128, scale.shape, generator=g).to(torch.int8)
                        offset = None if offset is None else scale.flip(1)
                        units = [torch.rand(N, 2, generator=g).half(), None]
                        units[1] = None if offset is None else -units[0]
                    zero = 0 if offsets else 2 ** (bits - 1)
                    values = pack(q, bits)
                    p = PackedWeight(values, scale, offset, zero, bits, block, "t", False, *units)
                    p = p.in_groups()
                    x = torch.randn(M, K, generator=g)
                    a, d = round_activations(x)
                    rounded = (a.double().view(M, K // 32, 32) * d.double()[..., None]).view(M, K)
                    want = rounded @ dequantize(p).double().T
                    got = op(x, p.values, p.scale, p.offset, p.super_scale, p.super_offset, bits,
                             block, zero).double()
                    worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    print(worst)
    """
)


NAN_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.ops.load_library(sys.argv[1])
    sys.path.insert(0, {tests!r})
    from native_nan_cases import BAD, FORMATS, check_rows, check_scales, kernel
    product = kernel(torch.ops.dikkat_native.qmm)
    for name, f in FORMATS.items():
        for M in (1, 3, 17, 40):
            for bad in BAD:
                check_rows(product, name, M, bad)
            for which in ["scale", "offset"] if f.offsets else ["scale"]:
                for bad in ("nan", "inf"):
                    check_scales(product, name, M, bad, which)
    print("ok")
    """
)


@pytest.fixture(scope="module", params=list(LESSER))
def library(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """qmm.cpp built for a CPU with AVX2 and none of AVX-512, then for one with no vector
    extension, each once for the tests below."""
    folder = tmp_path_factory.mktemp(request.param)
    return portable_build(folder, [native._SOURCES[0]], LESSER[request.param]), request.param


def test_the_portable_loops_give_the_reference_products(library: tuple[Path, str]):
    path, cpu = library
    printed = run_with(path, SCRIPT).strip().splitlines()
    assert printed[0] == cpu  # the build multiplies in the path made for such a CPU
    assert float(printed[-1]) < 1e-5


def test_the_portable_loops_keep_nan_and_inf(library: tuple[Path, str]):
    """The checks of tests/kernels/test_nan.py, every format, in the portable builds."""
    tests = str(Path(__file__).parents[1])
    assert run_with(library[0], NAN_SCRIPT.format(tests=tests)).strip().splitlines()[-1] == "ok"
