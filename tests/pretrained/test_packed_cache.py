"""The packed cache (dikkat/pretrained/packed_cache.py): a large GGUF file's repacked matrices
kept after its first load and mapped by the next, which gives the same model; an entry that no
longer matches is repacked; a changed file gets a new entry; a failed load leaves nothing."""

from __future__ import annotations

import os

import pytest
import tiny_gguf as tg
import torch

import dikkat.pretrained.loading as loading
import dikkat.pretrained.packed_cache as packed_cache
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.packed_cache import PackedCache

pytest.importorskip("gguf")


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A tiny GGUF file, and a cache folder of its own that takes any file (no minimum)."""
    path = tmp_path / "tiny.gguf"
    tg.tiny_llama_file(path)
    folder = tmp_path / "cache"
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: folder)
    monkeypatch.setattr(packed_cache, "MIN_BYTES", 0)
    return path, folder / "packed"


def logits(path) -> torch.Tensor:
    model = loading.load(path).model
    with torch.no_grad():
        return model(torch.tensor([tg.prompt_ids()]))


def entries(folder) -> list[str]:
    return sorted(p.suffix for p in folder.iterdir()) if folder.exists() else []


def test_the_second_load_maps_the_first_one_s_repacking(cached, monkeypatch):
    path, folder = cached
    first = logits(path)
    assert entries(folder) == [".bin", ".json"]
    repacked = []
    original = loading._packed
    monkeypatch.setattr(loading, "_packed", lambda *a: repacked.append(a) or original(*a))
    assert torch.equal(logits(path), first)
    assert repacked == []  # every matrix came from the cache
    weights = PackedCache(GGUFFile(path)).read()
    assert weights is not None and weights["blk.0.attn_q.weight"].grouped


def test_a_damaged_entry_is_repacked_and_written_again(cached, capfd):
    path, folder = cached
    first = logits(path)
    data = next(folder.glob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one bit pattern changed, the size kept
    data.write_bytes(bytes(raw))
    assert torch.equal(logits(path), first)
    assert "is damaged (it differs from its index): repacking" in capfd.readouterr().err
    assert PackedCache(GGUFFile(path)).read() is not None  # written again, whole


def test_a_changed_file_gets_a_new_entry_and_the_old_one_goes(cached):
    path, folder = cached
    logits(path)
    old = sorted(folder.iterdir())
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    logits(path)
    new = sorted(folder.iterdir())
    assert len(new) == 2 and not set(new) & set(old)


def test_a_failed_load_leaves_no_entry_and_no_temporary_file(cached, monkeypatch):
    path, folder = cached
    calls = []
    original = loading._packed

    def fails_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("a damaged block")
        return original(*args)

    monkeypatch.setattr(loading, "_packed", fails_third)
    with pytest.raises(ValueError, match="a damaged block"):
        loading.load(path)
    assert list(folder.iterdir()) == []


def test_small_files_are_not_cached(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    tg.tiny_llama_file(path)
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: tmp_path / "cache")
    loading.load(path)
    assert path.stat().st_size < packed_cache.MIN_BYTES
    assert not (tmp_path / "cache").exists()


def test_the_key_follows_the_code_that_repacks(cached, monkeypatch):
    """A dikkat whose formats, fix-ups or loader changed reads no entry of an older one."""
    path, _ = cached
    file = GGUFFile(path)
    before = PackedCache(file).key
    assert PackedCache(file).key == before  # the same file and code: the same entry
    monkeypatch.setattr(packed_cache, "_code", lambda: b"another dikkat's loader")
    assert PackedCache(file).key != before


def test_a_changed_index_is_repacked_too(cached, capfd):
    """The index checks its own listing: a moved offset is not read as weights."""
    import json

    path, folder = cached
    first = logits(path)
    index_path = next(folder.glob("*.json"))
    index = json.loads(index_path.read_text())
    index["tensors"]["blk.0.attn_q.weight"]["parts"]["scale"][0] += 64
    index_path.write_text(json.dumps(index))
    assert torch.equal(logits(path), first)
    assert "is damaged" in capfd.readouterr().err


def test_a_cache_that_cannot_be_written_leaves_the_load_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    tg.tiny_llama_file(path)
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: blocked)  # mkdir under it fails
    monkeypatch.setattr(packed_cache, "MIN_BYTES", 0)
    model = loading.load(path).model
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([tg.prompt_ids()]))).all()
    assert blocked.read_text() == ""
