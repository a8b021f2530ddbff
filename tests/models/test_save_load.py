"""Saving and loading GPT, BERT and Seq2Seq: round trips, tied weights, clear errors, atomicity.

A checkpoint is a directory with ``config.json`` and ``model.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

import dikkat.models.io as io
from dikkat.models import BERT, GPT, BERTConfig, GPTConfig, Seq2Seq, Seq2SeqConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Move every parameter off its init (LayerNorms included), so a lost weight shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def gpt(**overrides: object) -> GPT:
    fields = dict(vocab_size=29, max_len=16, d_model=16, n_layers=2, n_heads=2)
    return GPT(GPTConfig(**{**fields, **overrides}))


def bert(**overrides: object) -> BERT:
    fields = dict(vocab_size=31, max_len=16, d_model=16, n_layers=2, n_heads=2)
    return BERT(BERTConfig(**{**fields, **overrides}))


def seq2seq(**overrides: object) -> Seq2Seq:
    fields = dict(
        src_vocab_size=23,
        tgt_vocab_size=19,
        max_len=16,
        d_model=16,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=2,
    )
    return Seq2Seq(Seq2SeqConfig(**{**fields, **overrides}))


def ids(high: int, T: int = 7, seed: int = 0) -> Tensor:
    return torch.randint(0, high, (2, T), generator=torch.Generator().manual_seed(seed))


def outputs(model: torch.nn.Module) -> Tensor:
    """The model's main output on fixed inputs."""
    c = model.config
    with torch.no_grad():
        if isinstance(model, GPT):
            return model(ids(c.vocab_size))
        if isinstance(model, BERT):
            x = ids(c.vocab_size)
            types = ids(c.type_vocab_size, seed=1)
            return model(x, None, types) if c.mlm_head else model.encode(x, None, types)
        return model(ids(c.src_vocab_size), ids(c.tgt_vocab_size, T=5, seed=1))


def ties(model: torch.nn.Module) -> list[bool]:
    """Each tie the model's config promises: True where the two names share one tensor."""
    c = model.config
    if isinstance(model, GPT):
        return [(model.lm_head.weight is model.tok_emb.weight) == c.tie_embeddings]
    if isinstance(model, BERT):
        return [] if model.mlm is None else [model.mlm.embedding.weight is model.tok_emb.weight]
    return [
        (model.out.weight is model.tgt_emb.weight) == c.tie_output,
        (model.tgt_emb.weight is model.src_emb.weight) == c.share_embeddings,
    ]


MODELS = {
    "gpt": gpt,
    "gpt-untied": lambda: gpt(tie_embeddings=False),
    "gpt-rope-gqa": lambda: gpt(position="rope", n_heads=4, n_kv_heads=2, bias=False),
    "bert": bert,
    "bert-no-head": lambda: bert(mlm_head=False),
    "seq2seq": seq2seq,
    "seq2seq-shared": lambda: seq2seq(tgt_vocab_size=23, share_embeddings=True, norm="pre"),
    "seq2seq-untied": lambda: seq2seq(tie_output=False),
}


@pytest.fixture(params=list(MODELS))
def model(request) -> torch.nn.Module:
    torch.manual_seed(0)
    return perturbed(MODELS[request.param](), seed=1)


def test_round_trip_gives_equal_outputs_and_keeps_ties(model, tmp_path):
    path = model.save(tmp_path / "ckpt")
    assert sorted(os.listdir(path)) == [CONFIG, WEIGHTS]
    loaded = type(model).load(path)
    assert type(loaded) is type(model)
    assert loaded.config == model.config
    assert all(ties(loaded)) and ties(loaded) == ties(model)
    torch.testing.assert_close(outputs(loaded.eval()), outputs(model), rtol=0, atol=0)
    own, back = model.state_dict(), loaded.state_dict()
    assert own.keys() == back.keys()
    for k in own:
        assert torch.equal(own[k], back[k]), k


def test_tied_tensors_are_stored_once(tmp_path):
    from safetensors.torch import load_file

    model = gpt()
    model.save(tmp_path)
    stored = load_file(tmp_path / WEIGHTS)
    assert "tok_emb.weight" in stored and "lm_head.weight" not in stored
    untied = gpt(tie_embeddings=False)
    untied.save(tmp_path / "untied")
    assert "lm_head.weight" in load_file(tmp_path / "untied" / WEIGHTS)


def test_config_json_names_the_model_and_its_config(tmp_path):
    model = seq2seq()
    model.save(tmp_path)
    meta = json.loads((tmp_path / CONFIG).read_text())
    assert meta["model"] == "Seq2Seq"
    assert meta["config"] == dataclasses.asdict(model.config)
    assert "dikkat_version" in meta


def test_saving_twice_needs_overwrite(tmp_path):
    first, second = perturbed(gpt(), seed=1), perturbed(gpt(), seed=2)
    first.save(tmp_path)
    with pytest.raises(ValueError, match="already holds a saved model; pass overwrite=True"):
        second.save(tmp_path)
    torch.testing.assert_close(outputs(GPT.load(tmp_path)), outputs(first), rtol=0, atol=0)
    second.save(tmp_path, overwrite=True)
    torch.testing.assert_close(outputs(GPT.load(tmp_path)), outputs(second), rtol=0, atol=0)
    assert sorted(os.listdir(tmp_path)) == [CONFIG, WEIGHTS]


def test_save_refuses_a_file_and_foreign_files(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        gpt().save(tmp_path / "file")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="files that dikkat did not write"):
        gpt().save(tmp_path / "notes")
    gpt().save(tmp_path / "notes", overwrite=True)  # written beside them; theirs are kept
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert isinstance(GPT.load(tmp_path / "notes"), GPT)


# --- verified loading -----------------------------------------------------------------------


def test_config_records_the_weights_and_damage_is_found(tmp_path):
    model = perturbed(gpt(), seed=3)
    model.save(tmp_path)
    recorded = json.loads((tmp_path / CONFIG).read_text())["weights"]
    data = bytearray((tmp_path / WEIGHTS).read_bytes())
    assert recorded["bytes"] == len(data)
    data[-5] ^= 0x01  # one bit of one weight: the file still parses
    (tmp_path / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors is damaged: its SHA-256 differs"):
        GPT.load(tmp_path)
    loaded = GPT.load(tmp_path, verify=False)  # the opt-out: the flipped bit is really loaded
    assert not torch.equal(outputs(loaded), outputs(model))


# --- clear errors ----------------------------------------------------------------------------


def test_missing_directory_or_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        GPT.load(tmp_path / "nowhere")
    gpt().save(tmp_path / "a")
    (tmp_path / "a" / WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS):
        GPT.load(tmp_path / "a")
    gpt().save(tmp_path / "b")
    (tmp_path / "b" / CONFIG).unlink()
    with pytest.raises(FileNotFoundError, match=CONFIG):
        GPT.load(tmp_path / "b")


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0])
def test_truncated_weights(tmp_path, keep):
    model = bert()
    model.save(tmp_path)
    weights = tmp_path / WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"damaged: .* bytes where .* were written"):
        BERT.load(tmp_path)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        BERT.load(tmp_path, verify=False)  # safetensors' own header check


def test_corrupt_config_json(tmp_path):
    gpt().save(tmp_path)
    (tmp_path / CONFIG).write_text("{not json")
    with pytest.raises(ValueError, match="config"):
        GPT.load(tmp_path)


@pytest.mark.parametrize(
    "make, load_as",
    [(bert, GPT), (gpt, Seq2Seq), (seq2seq, BERT), (bert, Seq2Seq)],
    ids=["bert-as-gpt", "gpt-as-seq2seq", "seq2seq-as-bert", "bert-as-seq2seq"],
)
def test_a_checkpoint_of_another_model_class(tmp_path, make, load_as):
    make().save(tmp_path)
    with pytest.raises(ValueError):
        load_as.load(tmp_path)


def test_a_config_naming_another_model_class(tmp_path):
    """Even with fields that would fit, the recorded class name must match."""
    gpt().save(tmp_path)
    meta = json.loads((tmp_path / CONFIG).read_text())
    meta["model"] = "BERT"
    (tmp_path / CONFIG).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="BERT"):
        GPT.load(tmp_path)


@pytest.mark.parametrize(
    "make, field, value",
    [
        (gpt, "d_model", 32),
        (gpt, "n_layers", 3),
        (gpt, "vocab_size", 30),
        (gpt, "tie_embeddings", False),
        (bert, "d_model", 24),
        (bert, "mlm_head", False),
        (seq2seq, "d_model", 32),
        (seq2seq, "n_decoder_layers", 1),
    ],
)
def test_weights_of_a_different_size(tmp_path, make, field, value):
    model = make()
    model.save(tmp_path)
    meta = json.loads((tmp_path / CONFIG).read_text())
    assert meta["config"][field] != value
    meta["config"][field] = value
    (tmp_path / CONFIG).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not fit the model's config"):
        type(model).load(tmp_path)


# --- atomic saving ---------------------------------------------------------------------------


def test_a_crash_while_writing_weights_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    old = perturbed(gpt(), seed=1)
    old.save(tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in (CONFIG, WEIGHTS)}
    real_save = io.save_file

    def crash_mid_save(tensors, filename, *args, **kwargs):
        real_save(tensors, filename, *args, **kwargs)
        with open(filename, "r+b") as f:  # leave half a file behind, as a crash would
            f.truncate(os.path.getsize(filename) // 2)
        raise OSError("disk full")

    monkeypatch.setattr(io, "save_file", crash_mid_save)
    with pytest.raises(OSError, match="disk full"):
        perturbed(gpt(d_model=32), seed=2).save(tmp_path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == [CONFIG, WEIGHTS]  # no temporary file left
    assert {name: (tmp_path / name).read_bytes() for name in (CONFIG, WEIGHTS)} == before
    monkeypatch.undo()
    torch.testing.assert_close(outputs(GPT.load(tmp_path)), outputs(old), rtol=0, atol=0)


def test_a_crash_on_the_first_save_leaves_no_files(tmp_path, monkeypatch):
    def crash(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        bert().save(tmp_path / "new")
    assert os.listdir(tmp_path / "new") == []


def test_a_crash_while_writing_the_config_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Weights and config are replaced together: a failed config never pairs with new weights."""
    old = perturbed(gpt(), seed=1)
    old.save(tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in (CONFIG, WEIGHTS)}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    # same shapes, other activation: mixed files would load without an error, and compute wrong
    new = perturbed(gpt(activation="relu"), seed=2)
    monkeypatch.setattr(io, "json", SimpleNamespace(dumps=crash, loads=json.loads))
    with pytest.raises(OSError, match="disk full"):
        new.save(tmp_path, overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [CONFIG, WEIGHTS]
    assert {name: (tmp_path / name).read_bytes() for name in (CONFIG, WEIGHTS)} == before
