"""Build llama.cpp's tools once, for benchmarks/llamacpp.py and benchmarks/serving_llamacpp.py:
the copy vendored by the llama-cpp-python sdist, fetched with ``pip download`` and built with
cmake.

    python benchmarks/llamacpp_build.py [--version 0.3.36] [--cache DIR] [--jobs 2]

The sdist, its unpacked tree and the build live in a cache outside the checkout
(``$XDG_CACHE_HOME/dikkat/llamacpp``, else ``~/.cache/dikkat/llamacpp``). A stamp file beside the
binaries holds the version and the cmake flags: while it matches and the binaries are there, they
are reused as they are. Prints the folder of the binaries.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from dikkat.files import atomic_write

VERSION = "0.3.36"  # the Makefile's LLAMACPP (the converter the tests run) too
TARGETS = (
    "llama-bench",
    "llama-perplexity",
    "llama-simple",
    "llama-tokenize",
    "llama-quantize",
    "llama-server",
)
# llama.cpp's own, nothing that reaches the network: no HTTPS, no tests, and the server without
# its web UI. The UI's assets come from tools/ui/dist if present, else from npm when
# LLAMA_BUILD_UI is on, else from a Hugging Face download when LLAMA_USE_PREBUILT_UI is on
# (scripts/ui-assets.cmake in the vendored tree): with both off and no dist/ folder, the server
# is built with an empty asset table and no step of the build reaches the network.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",  # llama-simple
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    # No AMX tile code, where -march=native would turn it on: on a CPU that has AMX but a virtual
    # machine that does not let a process use its tiles (seen on a 2-core Sapphire Rapids VM
    # here), llama.cpp's AMX product dies of SIGILL at its first `tileloadd`, in prefill.
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
)


class LlamaCppError(Exception):
    """A step that cannot go on, said in one line (the scripts exit non-zero with it)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dikkat" / "llamacpp"


def run(cmd: list[str], what: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``cmd`` run to its end, or a LlamaCppError naming ``what`` with its last stderr line."""
    try:
        # errors="replace": a random model's text may stop inside a character (U+FFFD there)
        done = subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaCppError(f"{what} failed: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise LlamaCppError(f"{what} failed (exit {done.returncode}): {last}")
    return done


def stamp_text(version: str) -> str:
    return f"llama-cpp-python {version}\n" + "\n".join(CMAKE_FLAGS) + "\n"


def build_llamacpp(cache: Path, version: str = VERSION, jobs: int = 2) -> Path:
    """The folder of the built binaries, building them first unless the stamp says they are."""
    build = cache / f"build-{version}"
    bins, stamp = build / "bin", build / "dikkat-stamp"
    built = all((bins / t).is_file() for t in TARGETS)
    if built and stamp.is_file() and stamp.read_text() == stamp_text(version):
        return bins
    if shutil.which("cmake") is None:
        raise LlamaCppError("cmake is not installed: install it (`pip install cmake` in a venv)")
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++", "clang++")):
        raise LlamaCppError("no C++ compiler (c++, g++, clang++ or $CXX): install one")
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        print(f"downloading the llama-cpp-python {version} sdist into {cache}", flush=True)
        # the sdist alone: its build requirements (scikit-build-core, cmake) may come as wheels
        pip = [sys.executable, "-m", "pip", "download", "--no-deps"]
        what = f"pip download of llama-cpp-python=={version}"
        name = "llama-cpp-python"
        run([*pip, "--no-binary", name, f"{name}=={version}", "-d", str(cache)], what, timeout=900)
    source = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    ninja = ["-G", "Ninja"] if shutil.which("ninja") else []
    log = cache / f"build-{version}.log"
    print(f"building llama.cpp with -j{jobs} (minutes; the log: {log})", flush=True)
    with log.open("w") as out:
        for cmd in (
            ["cmake", "-S", str(source), "-B", str(build), *ninja, *CMAKE_FLAGS],
            ["cmake", "--build", str(build), f"-j{jobs}", "--target", *TARGETS],
        ):
            try:  # a 2-core build takes minutes; two hours means something is stuck
                done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=7200)
            except subprocess.TimeoutExpired:
                raise LlamaCppError(f"building llama.cpp took over 2 hours: see {log}") from None
            if done.returncode != 0:
                raise LlamaCppError(f"building llama.cpp failed: see {log}")
    atomic_write(stamp, lambda tmp: Path(tmp).write_text(stamp_text(version)))
    return bins


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=VERSION, help="the llama-cpp-python sdist's")
    parser.add_argument("--cache", type=Path, default=cache_dir())
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = parser.parse_args(argv)
    try:
        bins = build_llamacpp(args.cache, args.version, args.jobs)
    except LlamaCppError as e:
        raise SystemExit(f"llamacpp_build.py: {e}") from None
    print(bins)
    return bins


if __name__ == "__main__":
    main()
