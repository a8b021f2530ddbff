"""dikkat's native kernels: C++ compiled on this machine at first use, cached, loaded as torch ops.

Seven kernels so far: in ``qmm.cpp``, ``qmm``, fp32 activations times a weight packed in blocks
of 4-, 6- or 8-bit integers (:mod:`dikkat.weights.packed` holds the formats and says what the
product is), ``qmm_ids``, each activation row times its own block of such a weight's rows (a
mixture's stacked experts), and ``qmm_experts``, a mixture's experts on their tokens with it; in
``dequantize.cpp``, ``dequantize``, the fp32 weight such blocks stand for (``qmm_layout.h``: how
both read the blocks); in ``linear.cpp``, ``linear_rows``, an fp32 row times an fp32 weight
(decoding's products, :class:`dikkat.weights.dense.Fp32Linear`); in ``paged_attention.cpp``,
``paged_attention``, a decode step's attention over keys and values in a pool of slots
(:class:`dikkat.models.static_step.PoolStep`); in ``argmax.cpp``, ``argmax_rows``, greedy
decoding's pick of each row's largest logit. The files are compiled into
one library with the system's C++ compiler against the installed PyTorch, for this CPU
(``-march=native``: AVX-512 VNNI where the CPU has it, else AVX2 where it has that, else plain
loops the compiler vectorises as it can), once per source, PyTorch version, compiler and CPU;
the library is kept under ``native`` in dikkat's cache (``~/.cache/dikkat/native``;
:func:`native_dir`), written under a temporary name and renamed into place, so a half-written
library is never loaded. Beside it, a record of its size
and SHA-256 (``<library>.sha256``, written the same way, after it) is checked before each load:
a library that no longer matches it (cut short on a full disk, overwritten) or has none is
rebuilt, with a line on stderr saying so — loading a damaged one kills the process (SIGBUS)
without a word. Its threads are PyTorch's own (``at::parallel_for``; ``torch.set_num_threads``).

Every kernel gives a NaN or ±Inf of its inputs on as IEEE arithmetic would in the same formula
(``qmm``, whose integer product cannot hold one, adds such an input's terms in fp32 apart).

Where there is no compiler, or ``DIKKAT_NATIVE=0`` is set, :func:`qmm_op` is None (and so are
the others) and the callers compute the same with PyTorch operations; a failed build says why,
once, in a warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dikkat.files import cache_dir

__all__ = [
    "argmax_op",
    "build",
    "cpu_identity",
    "dequantize_op",
    "linear_rows_op",
    "native_dir",
    "paged_attention_op",
    "qmm_op",
]

_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("qmm.cpp", "linear.cpp", "paged_attention.cpp", "argmax.cpp", "dequantize.cpp")
]
# included by the sources: in the key too
_HEADERS = [Path(__file__).with_name(name) for name in ("qmm_layout.h", "qmm_vnni.h", "qmm_avx2.h")]
_LIBRARY = "dikkat_native"


def native_dir() -> Path:
    """Where compiled kernels are kept: ``native`` in dikkat's cache (``$DIKKAT_CACHE``, else
    ``$XDG_CACHE_HOME/dikkat``, else ``~/.cache/dikkat``: :func:`dikkat.files.cache_dir`)."""
    return cache_dir() / "native"


@functools.cache
def cpu_identity() -> str:
    """This CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted)


def _command(compiler: str, sources: list[Path], out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    lib = library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        "-O3",
        "-march=native",
        "-fopenmp",  # at::parallel_for's OpenMP region; libgomp resolves to torch's own copy
        "-ffp-contract=off",  # a · b + c rounded twice, as PyTorch computes it (no fused FMA)
        "-shared",
        "-fPIC",
        "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
        *(str(source) for source in sources),
        "-o",
        str(out),
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
    ]


def build(folder: Path | None = None, *, quiet: bool = False) -> Path:
    """Compile the kernels into one library in ``folder`` (default :func:`native_dir`) unless
    one built from the same sources, PyTorch, compiler and CPU is there and matches its record
    (else it is rebuilt, saying why on stderr); returns its path. A RuntimeError with the
    compiler's message where the build fails."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    source = b"\0".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        b"\0".join(s.encode() if isinstance(s, str) else s for s in
                   (source, torch.__version__, version, cpu_identity(), sys.platform))
    ).hexdigest()[:16]  # fmt: skip
    folder = native_dir() if folder is None else folder
    target = folder / f"{_LIBRARY}-{key}.so"
    if target.is_file():
        damage = _damage(target)
        if damage is None:
            return target
        print(f"dikkat: the cached native library {target} {damage}; rebuilding it",
              file=sys.stderr)  # fmt: skip
    elif not quiet:
        print("dikkat: compiling its native kernels for this CPU (once)…", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run(
            _command(compiler, _SOURCES, out), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise RuntimeError(
                f"{compiler} could not build {', '.join(p.name for p in _SOURCES)}: "
                f"{(errors or done.stderr.splitlines() or ['no message'])[0]}"
            )
        record = Path(tmp) / _record(target).name
        record.write_text(_fingerprint(out))
        os.replace(out, target)  # whole or absent: a rename within one folder
        os.replace(record, _record(target))  # after the library: a record names a whole one
    return target


def _record(library: Path) -> Path:
    """Where the size and SHA-256 of ``library`` are kept: beside it, ``<name>.sha256``."""
    return library.with_name(library.name + ".sha256")


def _fingerprint(library: Path) -> str:
    """The record of ``library``: ``"<size> <sha256>"``."""
    digest = hashlib.sha256()
    with library.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"{library.stat().st_size} {digest.hexdigest()}"


def _damage(library: Path) -> str | None:
    """What is wrong with a cached ``library`` (no record, or not the size and hash recorded),
    or None where it matches its record."""
    try:
        recorded = _record(library).read_text().strip()
    except OSError:
        return "has no record of its size and hash"
    found = _fingerprint(library)
    if found == recorded:
        return None
    size, want = found.split(" ")[0], recorded.split(" ")[0]
    if size != want:
        return f"is {size} bytes, not the {want} its record says"
    return "does not have the SHA-256 its record says"


@functools.cache
def qmm_op() -> Callable[..., Tensor] | None:
    """``torch.ops.dikkat_native.qmm``, built and loaded on first call; None where native
    kernels are turned off (``DIKKAT_NATIVE=0``) or cannot be built (with a warning saying
    why)."""
    if os.environ.get("DIKKAT_NATIVE", "1") == "0":
        return None
    if not hasattr(torch.ops, _LIBRARY) or not hasattr(torch.ops.dikkat_native, "qmm"):
        try:
            torch.ops.load_library(str(build()))
        except (RuntimeError, OSError) as e:
            warnings.warn(
                f"dikkat's native kernels are not available ({e}); packed weights are "
                "multiplied with PyTorch operations, which is slower",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        _register_fake()
    return torch.ops.dikkat_native.qmm


_KERNELS: dict[str, Callable[..., Tensor] | None] = {}


def _kernel(name: str) -> Callable[..., Tensor] | None:
    """``torch.ops.dikkat_native.<name>`` where :func:`qmm_op` is available, else None, kept in
    a plain dict once looked up: torch.compile reads it as a constant where it traces a call
    (it does not trace into :func:`qmm_op`'s ``functools.cache``), so callers look a kernel up
    once outside a compiled region (a layer's or a step's construction), then in it."""
    if name not in _KERNELS:
        _KERNELS[name] = None if qmm_op() is None else getattr(torch.ops.dikkat_native, name)
    return _KERNELS[name]


def dequantize_op() -> Callable[..., Tensor] | None:
    """``torch.ops.dikkat_native.dequantize`` where :func:`qmm_op` is available, else None."""
    return _kernel("dequantize")


def linear_rows_op() -> Callable[..., Tensor] | None:
    """``torch.ops.dikkat_native.linear_rows`` (x (M, K) fp32, w (N, K) fp32, bias (N,) or None
    → x wᵀ + bias, (M, N); made for one row: further rows are multiplied one after another, with
    the rows of w from cache) where :func:`qmm_op` is available, else None."""
    return _kernel("linear_rows")


def qmm_ids_op() -> Callable[..., Tensor] | None:
    """``torch.ops.dikkat_native.qmm_ids`` (x (M, K), ids (M,) int64, the packed weight's
    tensors, ``rows`` → (M, rows): row m times the weight's rows [ids[m] · rows, ids[m] · rows +
    rows), a multiple of 16) where :func:`qmm_op` is available, else None."""
    return _kernel("qmm_ids")


def qmm_experts_op() -> Callable[..., Tensor] | None:
    """``torch.ops.dikkat_native.qmm_experts``: a mixture's experts stacked as packed blocks,
    each token through its k picks, weighted and summed
    (:meth:`dikkat.weights.packed_layers.PackedExperts.mix`) where :func:`qmm_op` is available,
    else None."""
    return _kernel("qmm_experts")


def paged_attention_op() -> Callable[..., Tensor] | None:
    """``torch.ops.dikkat_native.paged_attention`` where :func:`qmm_op` is available, else
    None."""
    return _kernel("paged_attention")


def argmax_op() -> Callable[..., Tensor] | None:
    """``torch.ops.dikkat_native.argmax_rows`` (x (B, V) fp32 → the first index of each row's
    largest value, (B,) int64, a NaN counting as the largest, as ``torch.argmax``) where the
    library is loaded already — a model with packed weights loads it — else None: greedy
    decoding never waits for a build of its own."""
    if qmm_op.cache_info().currsize == 0 or qmm_op() is None:
        return None
    return torch.ops.dikkat_native.argmax_rows


def _register_fake() -> None:
    """The ops' output shapes for torch.compile / export (which trace it without running it)."""

    @torch.library.register_fake(f"{_LIBRARY}::qmm")
    def _(
        x: Tensor,
        values: Tensor,
        scale: Tensor,
        offset: Tensor | None,
        super_scale: Tensor | None,
        super_offset: Tensor | None,
        bits: int,
        block: int,
        zero: int,
    ) -> Tensor:
        return x.new_empty(x.shape[0], values.shape[0])

    @torch.library.register_fake(f"{_LIBRARY}::qmm_ids")
    def _(
        x: Tensor,
        ids: Tensor,
        values: Tensor,
        scale: Tensor,
        offset: Tensor | None,
        super_scale: Tensor | None,
        super_offset: Tensor | None,
        bits: int,
        block: int,
        zero: int,
        rows: int,
    ) -> Tensor:
        return x.new_empty(x.shape[0], rows)

    @torch.library.register_fake(f"{_LIBRARY}::qmm_experts")
    def _(x: Tensor, *rest: Any) -> Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(f"{_LIBRARY}::dequantize")
    def _(
        values: Tensor, scale: Tensor, offset: Tensor | None, bits: int, block: int, zero: int
    ) -> Tensor:
        return scale.new_empty(values.shape[0], values.shape[1] * 8 // bits, dtype=torch.float32)

    @torch.library.register_fake(f"{_LIBRARY}::linear_rows")
    def _(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake(f"{_LIBRARY}::argmax_rows")
    def _(x: Tensor) -> Tensor:
        return x.new_empty(x.shape[0], dtype=torch.long)

    @torch.library.register_fake(f"{_LIBRARY}::paged_attention")
    def _(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        slots: Tensor,
        positions: Tensor,
        window: int,
        scale: float,
    ) -> Tensor:
        return torch.empty_like(q)
