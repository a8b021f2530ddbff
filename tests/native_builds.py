"""dikkat's native kernels built for a CPU without some of this one's features, and run in a
process of their own: the tests of the AVX2 paths and plain loops that such CPUs run
(tests/kernels/).

Such a build registers the same ops as the library dikkat loads, so it runs where dikkat's own
is off (``DIKKAT_NATIVE=0``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dikkat import kernels

# The CPUs with less than the one the suite runs on, as compiler flags: AVX2 with FMA and F16C
# (x86's common ground since 2013: the kernels' second path), and no vector extension at all (the
# plain loops, which other CPUs compile as they can).
LESSER = {"avx2": ("-mno-avx512f",), "plain": ("-mno-avx512f", "-mno-avx2")}


def portable_build(folder: Path, sources: list[Path], without: tuple[str, ...]) -> Path:
    """``sources`` compiled as dikkat builds them, less the features ``without`` names
    (compiler flags: ``-mno-avx512f``), into ``folder``; skips where there is no compiler."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = folder / "portable.so"
    command = kernels._command(compiler, sources, out)
    at = command.index("-march=native") + 1
    command[at:at] = without
    built = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    return out


def run_with(library: Path, script: str) -> str:
    """What ``script`` prints, run by this Python in a process of its own with ``library`` as
    its ``sys.argv[1]``."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(library)], capture_output=True, text=True,
        check=False, env={**os.environ, "DIKKAT_NATIVE": "0"}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
