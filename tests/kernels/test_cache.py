"""The native library's cache (dikkat.kernels.build): a library is kept with a record of its
size and SHA-256, and one that no longer matches it — cut short, its bytes changed, its record
lost — is said to be so on stderr and rebuilt, never loaded (a cut one kills the process that
loads it with SIGBUS, so that case runs in a process of its own).

The library is compiled once, into the default cache (as every test of a kernel has it); the
rebuilds here run a stand-in for the compiler that answers ``--version`` as the real one does
(so that the cache's key is the same) and "builds" by copying that library, counting its calls."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dikkat import kernels as native

CHILD = textwrap.dedent(
    """
    import torch
    from dikkat import kernels as native
    from dikkat.weights.packed import dequantize, packed_linear
    from dikkat.weights.block_quantize import quantize_q8
    assert native.qmm_op() is not None
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.randn(20, 64, generator=g)
    p = quantize_q8(w)
    want = x.double() @ dequantize(p).double().T
    assert (packed_linear(x, p).double() - want).abs().max() < 1e-3 * want.abs().max()
    print("ok")
    """
)


@pytest.fixture(scope="module")
def whole() -> Path:
    """The library for this machine, in the default cache (compiled there if it is not yet)."""
    if os.environ.get("CXX") is None and shutil.which("c++") is None and not shutil.which("g++"):
        pytest.skip("no C++ compiler")
    return native.build()


@pytest.fixture
def stand_in(tmp_path: Path, whole: Path) -> tuple[Path, Path]:
    """A compiler that gives the real one's ``--version`` and copies ``whole`` to its ``-o``;
    returns it and the file in which it counts its builds."""
    real = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    count = tmp_path / "builds"
    script = tmp_path / "c++"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = --version ]; then exec {real} --version; fi
        while [ $# -gt 0 ]; do if [ "$1" = -o ]; then out="$2"; fi; shift; done
        echo built >> {count}
        cp {whole} "$out"
        """)
    )
    script.chmod(0o755)
    return script, count


def cached(tmp_path: Path, whole: Path, record: bool = True) -> Path:
    """``whole`` copied into the cache under ``tmp_path`` (as ``XDG_CACHE_HOME``), with its
    record or without; returns the copy."""
    folder = tmp_path / "cache" / "dikkat" / "native"
    folder.mkdir(parents=True)
    shutil.copy(whole, folder / whole.name)
    if record:
        shutil.copy(native._record(whole), native._record(folder / whole.name))
    return folder / whole.name


def builds(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def test_a_cut_library_is_rebuilt_not_loaded(tmp_path, whole, stand_in):
    compiler, count = stand_in
    library = cached(tmp_path, whole)
    with library.open("r+b") as f:
        f.truncate(4096)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": str(compiler),
           "DIKKAT_NATIVE": "1"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
    said = [line for line in done.stderr.splitlines() if line.startswith("dikkat:")]
    assert len(said) == 1 and f"{library} is 4096 bytes" in said[0] and "rebuilding" in said[0]
    assert builds(count) == 1
    assert library.read_bytes() == whole.read_bytes()
    assert native._record(library).read_text() == native._fingerprint(library)
    assert sorted(p.name for p in library.parent.iterdir()) == [
        library.name, native._record(library).name,
    ]  # fmt: skip


@pytest.mark.parametrize("damage", ["no record", "other bytes"])
def test_a_library_unlike_its_record_is_rebuilt(tmp_path, whole, stand_in, damage, monkeypatch,
                                                capsys):  # fmt: skip
    compiler, count = stand_in
    library = cached(tmp_path, whole, record=damage != "no record")
    if damage == "other bytes":  # the same size
        data = bytearray(library.read_bytes())
        data[len(data) // 2] ^= 0xFF
        library.write_bytes(bytes(data))
    monkeypatch.setenv("CXX", str(compiler))
    assert native.build(library.parent) == library
    said = capsys.readouterr().err.splitlines()
    reason = "has no record" if damage == "no record" else "does not have the SHA-256"
    assert len(said) == 1 and reason in said[0], said
    assert builds(count) == 1 and library.read_bytes() == whole.read_bytes()
    assert native._record(library).read_text() == native._fingerprint(library)


def test_a_build_keeps_its_record_and_is_then_reused(tmp_path, whole, stand_in, monkeypatch,
                                                     capsys):  # fmt: skip
    compiler, count = stand_in
    monkeypatch.setenv("CXX", str(compiler))
    folder = tmp_path / "fresh"
    library = native.build(folder, quiet=True)
    assert library.name == whole.name and builds(count) == 1
    size, digest = native._record(library).read_text().split(" ")
    assert int(size) == whole.stat().st_size and len(digest) == 64
    assert native.build(folder) == library and builds(count) == 1  # whole: loaded as it is
    assert capsys.readouterr().err == ""


def test_the_kernels_live_in_dikkat_s_one_cache(tmp_path, monkeypatch):
    """``$DIKKAT_CACHE`` moves the compiled kernels with the models; else the XDG cache."""
    from dikkat.pretrained.sources import cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DIKKAT_CACHE", raising=False)
    assert native.native_dir() == tmp_path / "xdg" / "dikkat" / "native"
    monkeypatch.setenv("DIKKAT_CACHE", str(tmp_path / "mine"))
    assert native.native_dir() == tmp_path / "mine" / "native" == cache_dir() / "native"
