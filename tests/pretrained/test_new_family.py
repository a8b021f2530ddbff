"""docs/models.md's "Adding a family", followed for a new tiny architecture: one family file
(:data:`FAMILY_FILE`, a Llama under another architecture name, other tensor names and a
tokenizer of its own name), placed where the registry lists the package's modules, is all it
takes for ``dikkat.pretrained.load`` to read a GGUF file of it — checked against the same
weights in a plain :class:`~dikkat.models.Decoder`."""

from __future__ import annotations

import sys

import pytest
import tiny_gguf as tg
import torch

import dikkat
from dikkat.models import Decoder, DecoderConfig
from dikkat.pretrained import families

ARCH, MODULE = "tinyllama-test", "tinyllama_test"

# The whole of the new family: what docs/models.md says such a file holds.
FAMILY_FILE = '''
"""tinyllama-test: a Llama whose GGUF files name their tensors their own way."""

from dikkat.models.decoder import Decoder
from dikkat.pretrained.families.base import GPT2_SPLIT, Family, PreSplit, Tensors, Weight
from dikkat.pretrained.families.common import llama_gguf_config

TENSORS = Tensors(
    model=(
        Weight("tok_emb", "tok_embeddings"),
        Weight("norm_f", "final_norm"),
        Weight("lm_head", "lm_out", when=lambda c: not c.tie_embeddings),
    ),
    layer=(
        Weight("attn.q_proj", "wq"),
        Weight("attn.k_proj", "wk"),
        Weight("attn.v_proj", "wv"),
        Weight("attn.out_proj", "wo"),
        Weight("mlp.gate", "w1"),
        Weight("mlp.up", "w3"),
        Weight("mlp.down", "w2"),
        Weight("attn_norm", "norm_attn"),
        Weight("mlp_norm", "norm_ffn"),
    ),
)


FAMILY = Family(
    name="tinyllama-test",
    model=Decoder,
    tensors=TENSORS,
    gguf_architecture="tinyllama-test",
    # Llama's header keys, under this architecture's name; the config's label is Llama's
    config_from_gguf=llama_gguf_config("llama", TENSORS),
    pre_splits={"tinyllama-test-bpe": PreSplit(GPT2_SPLIT)},
)
'''


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """The family file in a folder of its own, that folder on the families package's path."""
    folder = tmp_path / "families"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(FAMILY_FILE)
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(folder)])
    yield
    sys.modules.pop(f"{families.__name__}.{MODULE}", None)


def reference() -> Decoder:
    tokens, _, _ = tg.byte_level_vocab()
    config = DecoderConfig(
        vocab_size=len(tokens), max_len=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        d_ff=48, norm_eps=1e-5, tie_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Decoder(config).eval()
    with torch.no_grad():  # norms away from 1, so that a norm read as another shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_file(model: Decoder, path) -> None:
    """``model`` as a GGUF file of the new architecture (F32 tensors, its own names)."""
    tokens, types, merges = tg.byte_level_vocab()
    c = model.config
    keys = [
        tg.Key("general.architecture", tg.STRING, ARCH),
        tg.Key(f"{ARCH}.block_count", tg.U32, c.n_layers),
        tg.Key(f"{ARCH}.context_length", tg.U32, c.max_len),
        tg.Key(f"{ARCH}.embedding_length", tg.U32, c.d_model),
        tg.Key(f"{ARCH}.feed_forward_length", tg.U32, c.d_ff),
        tg.Key(f"{ARCH}.attention.head_count", tg.U32, c.n_heads),
        tg.Key(f"{ARCH}.attention.head_count_kv", tg.U32, c.kv_heads),
        tg.Key(f"{ARCH}.attention.layer_norm_rms_epsilon", tg.F32, c.norm_eps),
        tg.Key("tokenizer.ggml.model", tg.STRING, "gpt2"),
        tg.Key("tokenizer.ggml.pre", tg.STRING, "tinyllama-test-bpe"),
        tg.Key("tokenizer.ggml.tokens", tg.ARRAY, tokens, tg.STRING),
        tg.Key("tokenizer.ggml.token_type", tg.ARRAY, types, tg.I32),
        tg.Key("tokenizer.ggml.merges", tg.ARRAY, merges, tg.STRING),
    ]
    names = families.by_gguf_architecture(ARCH, "test").tensors.gguf(c)
    state = model.state_dict()
    tensors = [
        tg.Tensor(theirs, tg.T_F32, tuple(state[ours].shape), state[ours].numpy().tobytes())
        for theirs, ours in names.items()
    ]
    path.write_bytes(tg.write(keys, tensors)[0])


def test_a_family_file_is_all_a_new_architecture_needs(registered, tmp_path):
    family = families.families()["tinyllama-test"]
    assert families.by_gguf_architecture(ARCH, "test") is family
    assert "blk.1.w3.weight" in family.tensors.gguf(reference().config)
    model, path = reference(), tmp_path / "tiny.gguf"
    write_file(model, path)
    loaded = dikkat.pretrained.load(path)
    assert isinstance(loaded.model, Decoder)
    ids = torch.tensor([tg.prompt_ids(20)])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), model(ids), rtol=0, atol=1e-5)
    text = "the quick brown fox"  # the file's tokenizer, split as the family declared
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text


def test_without_its_file_the_architecture_is_refused_by_name(registered, tmp_path, monkeypatch):
    write_file(reference(), tmp_path / "tiny.gguf")
    monkeypatch.setattr(families, "__path__", families.__path__[:-1])
    with pytest.raises(ValueError, match="GGUF architecture 'tinyllama-test' is not one dikkat"):
        dikkat.pretrained.load(tmp_path / "tiny.gguf")


def test_every_family_of_the_package_is_registered_once():
    found = families.families()
    assert set(found) == {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3moe",
        "smollm3",
        "olmo2",
        "phi3",
        "gemma2",
        "gemma3",
        "gpt2",
        "starcoder2",
    }
    archs = [f.gguf_architecture for f in found.values() if f.gguf_architecture]
    assert sorted(archs) == [
        "gemma2",
        "gemma3",
        "gpt2",
        "llama",
        "olmo2",
        "phi3",
        "qwen2",
        "qwen3",
        "qwen3moe",
        "smollm3",
        "starcoder2",
    ]
    assert families.by_hf_model_type("gemma3_text", "test") is found["gemma3"]
    with pytest.raises(ValueError, match="multimodal Gemma 3"):
        families.by_hf_model_type("gemma3", "test")


def test_one_name_table_gives_both_formats_names():
    llama = families.families()["llama"]
    config = DecoderConfig(n_layers=1, qkv_bias=True, tie_embeddings=False)
    gguf, hf = llama.tensors.gguf(config), llama.tensors.hf(config)
    assert gguf["blk.0.attn_q.bias"] == hf["model.layers.0.self_attn.q_proj.bias"]
    assert sorted(gguf.values()) == sorted(hf.values())
    assert set(gguf.values()) <= set(Decoder(config).state_dict())
