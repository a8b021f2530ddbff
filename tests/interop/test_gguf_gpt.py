"""A dikkat GPT written as a GGUF file (``dikkat.interop.write_gguf``): ``gpt2`` as llama.cpp's
converter lays GPT-2 out, ``starcoder2`` for a GPT with RoPE (both read by gguf's own
``GGUFReader``), read back by ``dikkat.pretrained.load`` and by transformers (an independent
reader of the same layouts), and the models and paths it refuses."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
import torch

import dikkat
from dikkat.interop import write_gguf
from dikkat.models import GPT, GPTConfig
from dikkat.text import ByteTokenizer

TEXT = "héllo wörld, the quick brown fox — 42 🦊"

SMALL = dict(vocab_size=256, max_len=48, d_model=32, n_layers=2, n_heads=4)
CONFIGS = {
    "tied": GPTConfig(**SMALL),
    "untied": GPTConfig(**SMALL, tie_embeddings=False),
    "gqa, d_ff 40": GPTConfig(**SMALL, n_kv_heads=2, d_ff=40),
    "no biases": GPTConfig(**SMALL, bias=False, norm_eps=1e-6),
    "rope": GPTConfig(**SMALL, position="rope", rope_base=500.0),
    "rope, untied, gqa": GPTConfig(
        **SMALL, position="rope", tie_embeddings=False, n_kv_heads=2, d_ff=40
    ),
}


def tiny_gpt(config: GPTConfig, seed: int = 0) -> GPT:
    """A GPT whose norms and biases are random too (initialisers leave them 1 and 0)."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def ids_of(text: str = TEXT) -> torch.Tensor:
    return torch.tensor([ByteTokenizer().encode(text)])


# the sizes of a GQA GPT of SMALL with d_ff 40, as the header keys llama.cpp reads
SIZES = {
    "context_length": 48,
    "embedding_length": 32,
    "feed_forward_length": 40,
    "block_count": 2,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
}


def header_of(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_the_file_has_llama_cpp_s_keys_and_tensors(tmp_path):
    from gguf import GGUFReader

    config = CONFIGS["gqa, d_ff 40"]
    path = write_gguf(tiny_gpt(config), ByteTokenizer(), tmp_path / "m.gguf", name="tiny")
    reader = GGUFReader(path)
    fields = header_of(reader)
    assert fields["general.architecture"] == "gpt2"
    assert fields["general.name"] == "tiny"
    assert fields["general.file_type"] == 0  # ALL_F32
    for key, value in SIZES.items():
        assert fields[f"gpt2.{key}"] == value, key
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5, rel=1e-6)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    assert len(fields["tokenizer.ggml.tokens"]) == len(fields["tokenizer.ggml.token_type"]) == 256
    assert fields["tokenizer.ggml.merges"] == []  # bytes: none, but the key llama.cpp needs
    assert fields["tokenizer.ggml.add_bos_token"] is False

    # GGUF dims fastest first: llama.cpp's create_tensor shapes for LLM_ARCH_GPT2
    C, V, T, ff, kv = 32, 256, 48, 40, 2 * 8  # kv: n_embd_gqa, 2 heads of 8
    expected = {
        "token_embd.weight": [C, V],
        "position_embd.weight": [C, T],
        "output_norm.weight": [C],
        "output_norm.bias": [C],
    }
    for i in range(2):
        expected |= {
            f"blk.{i}.attn_norm.weight": [C],
            f"blk.{i}.attn_norm.bias": [C],
            f"blk.{i}.attn_qkv.weight": [C, C + 2 * kv],
            f"blk.{i}.attn_qkv.bias": [C + 2 * kv],
            f"blk.{i}.attn_output.weight": [C, C],
            f"blk.{i}.attn_output.bias": [C],
            f"blk.{i}.ffn_norm.weight": [C],
            f"blk.{i}.ffn_norm.bias": [C],
            f"blk.{i}.ffn_up.weight": [C, ff],
            f"blk.{i}.ffn_up.bias": [ff],
            f"blk.{i}.ffn_down.weight": [ff, C],
            f"blk.{i}.ffn_down.bias": [C],
        }
    got = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    assert got == expected  # tied: no output.weight, llama.cpp takes token_embd
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}


def test_a_rope_gpt_is_a_starcoder2_file(tmp_path):
    from gguf import GGUFReader

    path = write_gguf(tiny_gpt(CONFIGS["rope, untied, gqa"]), ByteTokenizer(), tmp_path / "m.gguf")
    reader = GGUFReader(path)
    fields = header_of(reader)
    assert fields["general.architecture"] == "starcoder2"
    rope = {"rope.dimension_count": 8, "rope.freq_base": 10000.0}  # whole heads
    for key, value in (SIZES | rope).items():
        assert fields[f"starcoder2.{key}"] == value, key
    # GGUF dims fastest first: llama.cpp's create_tensor shapes for LLM_ARCH_STARCODER2
    C, V, ff, kv = 32, 256, 40, 2 * 8
    expected = {
        "token_embd.weight": [C, V],
        "output.weight": [C, V],
        "output_norm.weight": [C],
        "output_norm.bias": [C],
    }
    for i in range(2):
        for name, shape in {
            "attn_norm": [C],
            "attn_q": [C, C],
            "attn_k": [C, kv],
            "attn_v": [C, kv],
            "attn_output": [C, C],
            "ffn_norm": [C],
            "ffn_up": [C, ff],
            "ffn_down": [ff, C],
        }.items():
            expected[f"blk.{i}.{name}.weight"] = shape
            expected[f"blk.{i}.{name}.bias"] = [shape[-1]]
    assert {t.name: [int(n) for n in t.shape] for t in reader.tensors} == expected


def test_an_untied_output_is_written(tmp_path):
    from gguf import GGUFReader

    model = tiny_gpt(CONFIGS["untied"])
    reader = GGUFReader(write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf"))
    output = next(t for t in reader.tensors if t.name == "output.weight")
    assert np.array_equal(output.data, model.lm_head.weight.detach().numpy())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_f32_round_trip_gives_the_same_model(name, tmp_path):
    config = CONFIGS[name]
    model = tiny_gpt(config)
    lm = dikkat.pretrained.load(write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf"))
    back = lm.model
    assert isinstance(back, GPT)
    same = {"bias": True} if not config.bias else {}  # written as zero biases
    assert back.config == GPTConfig(**{**config.__dict__, **same})
    theirs = back.state_dict()
    for key, t in model.state_dict().items():
        assert torch.equal(theirs[key], t), key  # fp32 is stored as is
    for key in set(theirs) - set(model.state_dict()):
        assert key.endswith(".bias") and not theirs[key].any(), key
    assert (back.lm_head.weight is back.tok_emb.weight) == config.tie_embeddings
    ids = ids_of()
    with torch.no_grad():
        want, got = model(ids), back(ids)
    if config.bias:
        assert torch.equal(got, want)
    else:  # x·Wᵀ + 0 may round apart from x·Wᵀ
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    prompt = ByteTokenizer().encode("the quick")
    assert lm.tokenizer.encode("the quick") == prompt
    greedy = dikkat.generate(model, [prompt], 12)[0]
    assert dikkat.generate(back, [prompt], 12)[0] == greedy
    # Pretrained runs the GPT too: the same tokens, as text
    assert lm.generate("the quick", 12) == lm.tokenizer.decode(greedy[len(prompt) :])


def test_f16_stores_the_matrices_in_half(tmp_path):
    from gguf import GGUFReader

    model = tiny_gpt(CONFIGS["untied"])
    path = write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf", dtype="f16")
    reader = GGUFReader(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert all(kinds[n] == ("F16" if n.endswith("weight") and "norm" not in n else "F32")
               for n in kinds), kinds  # fmt: skip
    assert reader.fields["general.file_type"].contents() == 1  # MOSTLY_F16
    # the reference: the model in fp64 with its matrices rounded to fp16, as the file holds them
    ref = tiny_gpt(CONFIGS["untied"]).double()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() > 1:
                p.copy_(p.half().double())
    lm = dikkat.pretrained.load(path, dtype=torch.float64)
    ids = ids_of()
    with torch.no_grad():
        exact, got = ref(ids), lm.model(ids)
    assert (got - exact).abs().max() < 1e-12  # the same numbers, computed alike in fp64
    with torch.no_grad():
        unrounded = model.double()(ids)
    assert (got - unrounded).abs().max() > 1e-6  # the fp16 rounding is there: not trivial


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_transformers_reads_the_file_as_gpt2(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = CONFIGS[name]
    model = tiny_gpt(config)
    path = write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf")
    # transformers maps context_length to GPT2Config's n_ctx, not to n_positions (the size of
    # wpe), which it leaves at 1024: given here
    hf = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float64, n_positions=config.max_len
    ).eval()
    ids = ids_of()
    with torch.no_grad():
        want, got = model.double()(ids), hf(ids).logits
    assert (got - want).abs().max() < 1e-9
    assert want.abs().max() > 0.1  # logits worth comparing


@pytest.mark.parametrize("name", ["rope", "rope, untied, gqa"])
def test_transformers_reads_a_rope_file_as_starcoder2(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = CONFIGS[name]
    model = tiny_gpt(config)
    path = write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf")
    # transformers' GGUF reader does not map rope.freq_base for starcoder2: given here
    theta = {"rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base}}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float64, **theta
    ).eval()
    assert type(hf).__name__ == "Starcoder2ForCausalLM"
    ids = ids_of()
    with torch.no_grad():
        want, got = model.double()(ids), hf(ids).logits
    assert (got - want).abs().max() < 1e-9
    assert want.abs().max() > 0.1


@pytest.mark.parametrize(
    ("change", "word"),
    [
        (dict(position="rope", activation="gelu"), "'starcoder2' model uses the tanh GELU"),
        (dict(activation="gelu"), "activation='gelu'"),
        (dict(activation="relu"), "activation='relu'"),
    ],
)
def test_what_llama_cpp_cannot_compute_is_refused(change, word, tmp_path):
    model = GPT(GPTConfig(**SMALL, **change))
    with pytest.raises(ValueError, match=word):
        write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_and_paths_are_refused(tmp_path):
    model = tiny_gpt(CONFIGS["tied"])
    with pytest.raises(TypeError, match="dikkat GPT"):
        write_gguf(torch.nn.Linear(2, 2), ByteTokenizer(), tmp_path / "m.gguf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf", dtype="q8_0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is a folder"):
        write_gguf(model, ByteTokenizer(), tmp_path)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="cannot write"):
        write_gguf(model, ByteTokenizer(), tmp_path / "file" / "m.gguf")
    path = write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf")
    before = path.read_bytes()
    with pytest.raises(ValueError, match="overwrite=True"):
        write_gguf(tiny_gpt(CONFIGS["tied"], seed=1), ByteTokenizer(), path)
    assert path.read_bytes() == before
    write_gguf(tiny_gpt(CONFIGS["tied"], seed=1), ByteTokenizer(), path, overwrite=True)
    assert path.read_bytes() != before


def test_a_failed_write_leaves_the_previous_file(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    model = tiny_gpt(CONFIGS["tied"])
    path = write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf")
    before = path.read_bytes()

    def full_disk(self: GGUFWriter) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(ValueError, match="No space left"):
        write_gguf(tiny_gpt(CONFIGS["tied"], seed=1), ByteTokenizer(), path, overwrite=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary file left


@pytest.mark.parametrize(
    ("method", "change", "word"),
    [
        ("add_rope_freq_base", "scaling", r"RoPE scaling \('yarn'\) is not implemented"),
        ("add_rope_dimension_count", "half", r"rope.dimension_count = 4: RoPE over part"),
    ],
)
def test_a_starcoder2_file_with_what_a_gpt_lacks_is_refused(method, change, word, tmp_path,
                                                             monkeypatch):  # fmt: skip
    from gguf import GGUFWriter

    original = getattr(GGUFWriter, method)

    def changed(self: GGUFWriter, value: float) -> None:  # the writer's key, altered
        if change == "half":
            value //= 2
        original(self, value)
        if change == "scaling":
            self.add_string("starcoder2.rope.scaling.type", "yarn")

    monkeypatch.setattr(GGUFWriter, method, changed)
    path = write_gguf(tiny_gpt(CONFIGS["rope"]), ByteTokenizer(), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=word):
        dikkat.pretrained.load(path)


def test_the_written_file_is_read_by_gguf_file(tmp_path):
    model = tiny_gpt(CONFIGS["tied"])
    path = write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf")
    file = dikkat.pretrained.GGUFFile(path)
    assert file.architecture == "gpt2"
    assert file.metadata["tokenizer.ggml.merges"] == []
    qkv = file.read("blk.1.attn_qkv.weight")
    attn = model.blocks[1].attn
    rows = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert torch.equal(qkv, torch.cat([w.detach() for w in rows]))
    assert Path(path).stat().st_size > 0


def test_generation_keeps_its_inference_copy_until_the_weights_change(tmp_path):
    """An fp32 model's inference copy (with its reordered weights, made at the first prompt) is
    made once for every call, and again after the model's weights are written to."""
    model = tiny_gpt(CONFIGS["tied"])
    lm = dikkat.pretrained.load(write_gguf(model, ByteTokenizer(), tmp_path / "m.gguf"))
    lm.compile_steps = False
    first = lm.generate("the quick", 8)
    copy = lm._runnable(None)
    assert lm.generate("the quick", 8) == first and lm._runnable(None) is copy
    with torch.no_grad():
        lm.model.blocks[0].mlp.up.weight.mul_(-3.0)
        model.blocks[0].mlp.up.weight.mul_(-3.0)
    fresh = lm._runnable(None)
    assert fresh is not copy
    ids = ids_of()
    with torch.no_grad():  # a prompt's rows: the products of the reordered copies
        assert torch.equal(fresh(ids), model(ids))
        assert not torch.equal(copy(ids), model(ids))
