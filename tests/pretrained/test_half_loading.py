"""A GGUF file's F16 and BF16 matrices stay 16-bit (dikkat.weights.half): fused q/k/v and gate/up
layers, the token table shared with a tied output layer, what the model holds near the file's
size, and the logits and greedy tokens of the file read as fp32 (transformers' reading)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_gguf as tg
import torch

import dikkat
from dikkat.weights import HalfEmbedding, HalfLinear, PackedLinear

pytest.importorskip("gguf")

KINDS = pytest.mark.parametrize("kind", [tg.T_F16, tg.T_BF16], ids=["F16", "BF16"])


def half_file(path, kind: int, **changes: int) -> None:
    """The tiny Llama of tiny_gguf.py with every matrix in ``kind`` (but those ``changes``
    names, in theirs)."""
    _, tensors = tg.tiny_llama()
    kinds = {t.name: kind for t in tensors if len(t.shape) == 2}
    tg.tiny_llama_file(path, kinds=kinds | changes)


def held_bytes(model: torch.nn.Module) -> int:
    tables = {id(m.table): m.table for m in model.modules() if isinstance(m, HalfEmbedding)}
    tables |= {id(t): t for m in model.modules() if isinstance(m, HalfLinear) for t in m.parts}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(t.numel() * t.element_size() for t in tables.values())


@KINDS
def test_a_16_bit_file_is_held_in_16_bits(tmp_path, kind):
    path = tmp_path / "half.gguf"
    half_file(path, kind)
    model = dikkat.pretrained.load(path).model
    dtype = torch.float16 if kind == tg.T_F16 else torch.bfloat16
    assert isinstance(model.tok_emb, HalfEmbedding) and model.tok_emb.table.dtype == dtype
    assert isinstance(model.lm_head, HalfLinear)
    assert model.lm_head.table is model.tok_emb.table  # tied: one table
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        assert isinstance(attn.qkv_proj, HalfLinear) and attn.k_proj.source is attn.qkv_proj
        assert isinstance(mlp.gate_up, HalfLinear) and mlp.up.source is mlp.gate_up
        assert isinstance(mlp.down, HalfLinear) and isinstance(attn.out_proj, HalfLinear)
    stored = sum(info.nbytes for info in dikkat.pretrained.GGUFFile(path).tensors.values())
    assert held_bytes(model) == stored  # the file's bytes, nothing widened beside them


@KINDS
def test_it_gives_the_logits_and_tokens_of_the_file_read_as_fp32(tmp_path, kind):
    path = tmp_path / "half.gguf"
    half_file(path, kind)
    half, fp32 = dikkat.pretrained.load(path), dikkat.pretrained.load(path, weights="fp32")
    for n in (1, 3, 32):  # a decode step's row, a few rows, a prefill's slices
        ids = torch.tensor([tg.prompt_ids(n)])
        with torch.no_grad():
            want = fp32.model(ids)
            torch.testing.assert_close(half.model(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    assert half.generate("the quick brown", 12) == fp32.generate("the quick brown", 12)


def test_q_k_v_kept_in_two_ways_are_expanded_together(tmp_path):
    """q in F16 beside k and v in blocks: no one layer holds both, so the three are fp32."""
    path = tmp_path / "mixed.gguf"
    tg.tiny_llama_file(path, kinds={"blk.0.attn_q.weight": tg.T_F16})
    model = dikkat.pretrained.load(path).model
    qkv = model.blocks[0].attn.qkv_proj
    assert not isinstance(qkv, HalfLinear | PackedLinear) and qkv.weight.dtype == torch.float32
    assert isinstance(model.blocks[1].attn.qkv_proj, PackedLinear)
    dense = dikkat.pretrained.load(path, weights="fp32").model
    assert torch.equal(qkv.weight, dense.blocks[0].attn.qkv_proj.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_16_bit_file_asked_for_in_another_dtype_is_read_as_fp32_and_cast(tmp_path, dtype):
    path = tmp_path / "half.gguf"
    half_file(path, tg.T_F16)
    model = dikkat.pretrained.load(path, dtype=dtype).model
    want = dikkat.pretrained.load(path, weights="fp32").model
    assert not [m for m in model.modules() if isinstance(m, HalfLinear | HalfEmbedding)]
    assert model.tok_emb.weight.dtype == dtype
    assert torch.equal(model.blocks[0].mlp.down.weight, want.blocks[0].mlp.down.weight.to(dtype))


def test_the_bytes_are_read_alike_in_the_map_and_by_reads(tmp_path, monkeypatch):
    """A tensor is used where it lies in the map; one at an offset its dtype's size does not
    divide is read into memory, by the system's vector reads or, without them, from the map."""
    path = tmp_path / "half.gguf"
    half_file(path, tg.T_BF16)
    file = dikkat.pretrained.GGUFFile(path)
    read = file.read_half("blk.1.ffn_down.weight")
    assert file.lies_in_map(read)
    assert torch.equal(read.float(), file.read("blk.1.ffn_down.weight"))
    info = file.tensors["blk.1.ffn_down.weight"]
    for vector_reads in (True, False):
        if not vector_reads:
            monkeypatch.delattr("os.preadv")
        copy = torch.empty(info.shape, dtype=torch.bfloat16)
        file._read_into(copy, info)
        assert torch.equal(copy, read) and not file.lies_in_map(copy)
    with pytest.raises(ValueError, match="stored as F32, not in 16 bits"):
        file.read_half("output_norm.weight")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_the_model_s_16_bit_tables_lie_where_the_file_is(tmp_path):
    """Every 16-bit table is the file's bytes where they lie (its private map, not a copy), but
    q and k, whose rows llama.cpp reordered (put back by a copy); a write changes the model's
    copy of a page, never the file."""
    path = tmp_path / "half.gguf"
    half_file(path, tg.T_F16)
    model = dikkat.pretrained.load(path).model
    spans = [
        tuple(int(a, 16) for a in line.split()[0].split("-"))
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.endswith(str(path))
    ]

    def mapped(t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() < b for a, b in spans)

    assert mapped(model.tok_emb.table)
    for block in model.blocks:
        q, k, v = block.attn.qkv_proj.parts
        assert not mapped(q) and not mapped(k) and mapped(v)
        assert all(map(mapped, (*block.mlp.gate_up.parts, *block.attn.out_proj.parts)))
    before = path.read_bytes()
    down = model.blocks[0].mlp.down.parts[0]
    down.add_(1.0)
    assert path.read_bytes() == before
    assert torch.equal(
        down, dikkat.pretrained.GGUFFile(path).read_half("blk.0.ffn_down.weight") + 1
    )


def test_a_file_cut_short_after_it_is_opened_is_refused(tmp_path):
    path = tmp_path / "half.gguf"
    half_file(path, tg.T_F16)
    file = dikkat.pretrained.GGUFFile(path)
    halves = [info for info in file.tensors.values() if info.kind_name == "F16"]
    last = max(halves, key=lambda info: info.offset)
    with path.open("r+b") as f:
        f.truncate(last.offset + 10)
    with pytest.raises(ValueError, match=f"{last.name}.*changed while it was read"):
        file.read_half(last.name)


def test_a_load_counts_the_bytes_it_reads_on_a_progress_bar(tmp_path, monkeypatch):
    """On a terminal a bar shows where reading takes more than a second (tqdm's delay)."""
    bars = []

    class Bar:
        def __init__(self, total, **options):
            self.total, self.done, self.options, self.closed = total, 0, options, False
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    monkeypatch.setattr("dikkat.pretrained.loading.tqdm", Bar)
    path = tmp_path / "half.gguf"
    half_file(path, tg.T_F16)
    dikkat.pretrained.load(path)
    stored = sum(info.nbytes for info in dikkat.pretrained.GGUFFile(path).tensors.values())
    (bar,) = bars
    assert bar.total == bar.done == stored and bar.closed
    assert bar.options["disable"] is None and bar.options["delay"] == 1.0  # terminals only
