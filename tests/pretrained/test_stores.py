"""Models where other tools keep them (dikkat.pretrained.stores): the Hugging Face hub's cache
laid out as huggingface_hub lays it out (blobs, snapshots of links, refs), ollama's store
(manifests naming sha256 blobs) and LM Studio's folder, built in a temporary folder; each found
by the name a user types, loaded as the same model, listed by ``dikkat models`` with what dikkat
says of it, and a name found nowhere refused with where dikkat looked."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_gguf import write_gguf
from tiny_hf import save_tiny

import dikkat
from dikkat.pretrained import stores
from helpers import run_cli

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("huggingface_hub")

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def hub_repo(hub: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """``files`` as huggingface_hub caches a download of ``repo_id``: each in ``blobs/`` under
    its hash, linked from ``snapshots/<commit>/``, the commit named by ``refs/main``."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def ollama_model(root: Path, parts: tuple[str, ...], tag: str, model: Path) -> Path:
    """``model`` as ollama keeps a pulled one: a blob under its digest, a manifest naming it."""
    data = model.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{digest}"
    blob.write_bytes(data)
    manifest = root / "manifests" / Path(*parts) / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


def refused_gguf(path: Path) -> Path:
    """A GGUF file of an architecture dikkat does not run."""
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama folder and the same model as a GGUF file."""
    folder = tmp_path_factory.mktemp("tiny")
    hf = save_tiny("llama", folder)
    return folder, write_gguf(hf, folder.parent / "tiny.gguf", "llama", chat_template=TEMPLATE)


@pytest.fixture
def places(tmp_path, monkeypatch, tiny):
    folder, file = tiny
    hub, ollama, lmstudio = tmp_path / "hub", tmp_path / "ollama", tmp_path / "lmstudio"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setattr(stores, "lmstudio_dirs", lambda: [lmstudio])
    hub_repo(hub, "org/tiny", {p.name: p for p in folder.iterdir() if p.is_file()})
    hub_repo(hub, "org/tiny-GGUF", {"tiny-Q8_0.gguf": file, "tiny-F32.gguf": file})
    ollama_model(ollama, ("registry.ollama.ai", "library", "tiny"), "latest", file)
    ollama_model(ollama, ("hf.co", "org", "tiny-GGUF"), "F32", file)
    (lmstudio / "pub" / "tiny-GGUF").mkdir(parents=True)
    shutil.copy(file, lmstudio / "pub" / "tiny-GGUF" / "tiny-F32.gguf")
    refused_gguf(lmstudio / "pub" / "falcon.gguf")
    return folder, file


def logits(source: object) -> torch.Tensor:
    with torch.no_grad():
        return dikkat.pretrained.load(source).model(torch.arange(2, 14).view(1, -1))


@pytest.mark.parametrize(
    ("name", "store", "kind"),
    [
        ("org/tiny", "hf", "hf"),
        ("hf:org/tiny", "hf", "hf"),
        ("org/tiny-GGUF:F32", "hf", "gguf"),
        ("tiny", "ollama", "gguf"),
        ("tiny:latest", "ollama", "gguf"),
        ("ollama:tiny", "ollama", "gguf"),
        ("hf.co/org/tiny-GGUF:F32", "ollama", "gguf"),
        ("pub/tiny-GGUF", "lmstudio", "gguf"),
        ("lmstudio:pub/tiny-GGUF/tiny-F32.gguf", "lmstudio", "gguf"),
    ],
)
def test_a_stored_model_is_found_by_its_name_and_is_the_same_model(places, name, store, kind):
    folder, _ = places
    found = stores.find(name)
    assert found is not None and (found.store, found.kind) == (store, kind)
    torch.testing.assert_close(logits(name), logits(folder), atol=1e-5, rtol=0)


def test_names_that_say_too_little_or_nothing_are_refused_saying_so(places):
    with pytest.raises(ValueError, match=r"several GGUF files; choose one with name:TAG"):
        stores.find("org/tiny-GGUF")
    with pytest.raises(ValueError, match=r"no GGUF file named with 'Q4_K_M'; it holds tiny-F32"):
        stores.find("org/tiny-GGUF:Q4_K_M")
    with pytest.raises(
        ValueError, match=r"nor in the Hugging Face cache \(.*hub\), ollama's store"
    ):
        dikkat.pretrained.load("org/absent")
    assert stores.find("tiny:7b") is None and stores.find("../etc") is None


def test_a_chat_runs_on_a_model_ollama_keeps(places, capsys):
    code, out, err = run_cli(["chat", "tiny", "-m", "hello", "-n", "4"], capsys)
    assert code == 0, err
    lm = dikkat.pretrained.load("tiny")
    assert out == lm.chat([{"role": "user", "content": "hello"}], 4, repetition_penalty=1.1) + "\n"


def test_models_lists_each_with_what_dikkat_says_of_it(places, capsys):
    code, out, err = run_cli(["models", "--json"], capsys)
    assert code == 0, err
    rows = {(r["store"], r["name"]): r for r in json.loads(out)}
    assert set(rows) == {
        ("hf", "org/tiny"),
        ("hf", "org/tiny-GGUF:tiny-F32"),
        ("hf", "org/tiny-GGUF:tiny-Q8_0"),
        ("ollama", "tiny:latest"),
        ("ollama", "hf.co/org/tiny-GGUF:F32"),
        ("lmstudio", "pub/tiny-GGUF/tiny-F32.gguf"),
        ("lmstudio", "pub/falcon.gguf"),
    }
    folder = rows["hf", "org/tiny"]
    assert folder["architecture"] == "llama" and folder["runs"] and folder["context"] == 128
    pulled = rows["ollama", "tiny:latest"]
    assert (pulled["architecture"], pulled["quantisation"], pulled["runs"]) == (
        "llama",
        "F32",
        True,
    )
    falcon = rows["lmstudio", "pub/falcon.gguf"]
    assert (
        not falcon["runs"] and "GGUF architecture 'falcon' is not one dikkat runs" in falcon["why"]
    )
    for row in rows.values():  # each name listed finds its model again
        assert stores.find(row["name"]) is not None
    code, out, _ = run_cli(["models"], capsys)
    assert code == 0 and "no: GGUF architecture 'falcon'" in out and "looked in" in out
