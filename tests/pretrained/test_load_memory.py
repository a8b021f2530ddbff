"""What a load leaves resident: the file's pages are let go once a tensor is copied
(``GGUFFile.let_go``), and neither loading nor generating pulls in torch's compiler stack (its
import alone is ~90 MiB resident, triton's library) or its symbolic shapes (sympy: half a
second of start-up)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_gguf as tg
import torch

from dikkat.pretrained.gguf_file import GGUFFile

pytest.importorskip("gguf")


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_let_go_drops_a_tensor_s_pages_and_a_later_read_is_the_same(tmp_path):
    rows, cols = 1024, 4096  # 16 MiB of fp32
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    keys = [tg.Key("general.architecture", tg.STRING, "none")]
    data, _ = tg.write(keys, [tg.Tensor("big", tg.T_F32, (rows, cols), values.tobytes())])
    path = tmp_path / "big.gguf"
    path.write_bytes(data)
    file = GGUFFile(path)
    before = resident_mib()
    assert int(file.raw("big").sum(dtype=np.int64)) > 0  # every page read: now resident
    touched = resident_mib()
    file.let_go("big")
    dropped = resident_mib()
    assert touched - before > 12 and touched - dropped > 12, (before, touched, dropped)
    assert torch.equal(file.read("big"), torch.from_numpy(values))  # faulted in again
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 1024\]"):
        file.let_go("big", (0, 1025))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_loading_and_generating_import_no_compiler(family, tmp_path):
    """A model built on the meta device to be given its weights skips its random fills (whose
    meta forms import torch._dynamo): a fresh process loads a GGUF file and decodes without
    it."""
    path = tmp_path / "tiny.gguf"
    if family == "llama":
        tg.tiny_llama_file(path)
    else:  # a GPT: its learned positions too
        from dikkat.interop import write_gguf
        from dikkat.models import GPT, GPTConfig
        from dikkat.text import ByteTokenizer

        config = GPTConfig(d_model=16, n_heads=2, n_layers=1, max_len=32)
        write_gguf(GPT(config), ByteTokenizer(), path)
    code = (
        "import sys, dikkat.pretrained as p\n"
        f"m = p.load({str(path)!r})\n"
        "m.generate('hi', max_new_tokens=3, temperature=0)\n"
        "heavy = ('torch._dynamo', 'triton', 'torch.fx.experimental.symbolic_shapes', 'sympy')\n"
        "print(sorted(n for n in heavy if n in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_tensor_repacked_in_slices_is_the_tensor_repacked_whole(tmp_path, monkeypatch):
    """The loader repacks a tensor in file order slice by slice into its result: slices of 16
    rows (and a last one shorter) give what one slice of all rows gives."""
    import dikkat.pretrained.loading as loading

    path = tmp_path / "tiny.gguf"
    tg.tiny_llama_file(path)
    whole = loading.load(path).model
    monkeypatch.setattr(loading, "SLICE_ROWS", 16)
    sliced = loading.load(path).model
    assert whole.tok_emb.packed.shape[0] % 16  # a last slice shorter than the others
    for a, b in zip(whole.tok_emb.packed.tensors(), sliced.tok_emb.packed.tensors(), strict=True):
        assert torch.equal(a, b)
    ids = torch.tensor([tg.prompt_ids()])
    with torch.no_grad():
        assert torch.equal(whole(ids), sliced(ids))
