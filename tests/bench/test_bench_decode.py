"""``dikkat bench decode`` on tiny Hugging Face folders written here (a real model is too slow
for the suite): its JSON and table, exactly --new-tokens decoded though the model's greedy
token is its EOS, the bytes per token against a count from the model's shapes, the loader
adapter, and the one-line errors. No figure is checked against a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dikkat
from dikkat.bench.bandwidth import kv_bytes, mean_kv_bytes, read_bandwidth, weight_bytes
from dikkat.bench.decode import DecodeBenchConfig, _load, random_ids
from dikkat.generation import SamplingParams, generate
from dikkat.models import Decoder, DecoderConfig
from dikkat.pretrained.families.llama import FAMILY as LLAMA
from dikkat.weights import inference_model, w8a8_available
from dikkat.weights.dense import Int8Linear
from helpers import run_cli

EOS = 0  # the tokenizer's </s>; a model whose final norm is zero gives every token logit 0,
# and the greedy pick of equal logits is the first: EOS

TINY = DecoderConfig(
    vocab_size=300,
    max_len=32,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=48,
    tie_embeddings=True,
)
SMALL_RUN = ["--prompt-tokens", "4", "--new-tokens", "4", "--prefill-tokens", "8"]
FAST = ["--threads", "1", "--probe-mib", "1"]
FORMATS = ["fp32", "bf16", "int8"] + ["w8a8"] * w8a8_available()


def save_hf_folder(model: Decoder, folder: Path) -> Path:
    """``model`` as a Llama-family Hugging Face folder: config.json, model.safetensors, and a
    byte-level tokenizer whose </s> (EOS) is id 0 and <s> (BOS) id 1."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    c = model.config
    folder.mkdir(parents=True, exist_ok=True)
    theirs = {ours: hf for hf, ours in LLAMA.tensors.hf(c).items()}
    state = model.state_dict()
    save_file({theirs[k]: state[k].contiguous() for k in theirs}, str(folder / "model.safetensors"))
    config = {
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.kv_heads,
        "max_position_embeddings": c.max_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_base,
        "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": EOS,
    }
    (folder / "config.json").write_text(json.dumps(config))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"</s>": EOS, "<s>": 1} | {ch: i + 2 for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>", "<s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return folder


def tiny_decoder(config: DecoderConfig = TINY, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(config).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_hf_folder(tiny_decoder(), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def eos_first(tmp_path_factory) -> Path:
    """A model whose greedy token is always EOS."""
    model = tiny_decoder()
    with torch.no_grad():
        model.norm_f.weight.zero_()
    return save_hf_folder(model, tmp_path_factory.mktemp("eos-first"))


# --- the bytes a decoded token reads, against the model's shapes --------------------------------


def hand_count(c: DecoderConfig, weights: str) -> int:
    """Bytes of the weights one token reads, from the config alone: every linear layer whole in
    its format (int8: a byte per weight and an fp32 scale per row), the RMSNorm scales in fp32,
    and one fp32 row of the embedding, unless an fp32 output projection shares its table. Of a
    mixture of experts, the fp32 router and the k experts a token picks."""
    C, V, F, L = c.d_model, c.vocab_size, c.d_ff, c.n_layers
    q, kv = c.n_heads * c.dim, c.kv_heads * c.dim
    mlp = [(F, C), (F, C), (C, F)] * (c.experts_per_token or 1)
    shapes = ([(q, C), (kv, C), (kv, C), (C, q), *mlp]) * L + [(V, C)]
    router = 4 * L * c.n_experts * C

    def matrix(N: int, K: int) -> int:
        if weights == "fp32":
            return 4 * N * K
        if weights == "bf16":
            return 2 * N * K
        return N * K + 4 * N  # int8, w8a8

    biases = L * (q + 2 * kv) * (2 if weights == "bf16" else 4) if c.qkv_bias else 0
    norms = 4 * (2 * L + 1) * C
    row = 0 if (c.tie_embeddings and weights == "fp32") else 4 * C
    return sum(matrix(N, K) for N, K in shapes) + biases + norms + row + router


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize(
    "config",
    [
        TINY,
        DecoderConfig(**{**TINY.__dict__, "tie_embeddings": False, "qkv_bias": True}),
        DecoderConfig(**{**TINY.__dict__, "n_experts": 4, "experts_per_token": 2}),
    ],
    ids=["tied", "untied-bias", "experts"],
)
def test_weight_bytes_match_a_count_from_the_shapes(config, weights):
    copy = inference_model(tiny_decoder(config), weights)
    assert weight_bytes(copy) == hand_count(config, weights)


def test_weight_bytes_take_a_layers_own_count():
    """A layer that states ``nbytes`` (a packed format) is counted at its word, once."""

    class Stated(Int8Linear):
        nbytes = 12345

    layer = Stated(torch.randn(8, 32), None, False)
    assert weight_bytes(layer) == 12345
    assert weight_bytes(torch.nn.Sequential(layer, layer)) == 12345  # one layer twice


def test_kv_bytes_count_keys_and_values_and_stop_at_a_window():
    config = DecoderConfig(
        **{**TINY.__dict__, "sliding_window": 3, "layer_kinds": ("full", "sliding")}
    )
    model = inference_model(tiny_decoder(config))
    per_position = 2 * config.kv_heads * config.dim * 4  # keys and values, fp32
    assert kv_bytes(model, 10) == per_position * (10 + 3)
    assert kv_bytes(model, 2) == per_position * (2 + 2)
    # a decode of 5 tokens after 4: the four timed steps see 5, 6, 7, 8 keys
    full = inference_model(tiny_decoder())
    assert mean_kv_bytes(full, 4, 5) == per_position * TINY.n_layers * (5 + 6 + 7 + 8) / 4


def test_random_ids_avoid_the_special_ids():
    ids = random_ids(2000, 10, {0, 1, 7}, torch.Generator().manual_seed(0))
    assert set(ids) == {2, 3, 4, 5, 6, 8, 9}
    with pytest.raises(ValueError, match="every id"):
        random_ids(3, 2, {0, 1}, torch.Generator())


def test_read_bandwidth_is_a_positive_rate():
    assert read_bandwidth(2**20) > 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc only")
def test_the_peak_memory_is_the_programs_own_not_its_parents():
    """A child started while this process holds 1.5 GB more reports its own peak: Linux's
    ``ru_maxrss`` would carry the parent's resident size across ``execve``."""
    held = b"\x01" * (1500 * 2**20)  # written, so resident
    code = "from dikkat.bench.bandwidth import peak_rss_mb; print(peak_rss_mb())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    del held
    assert 0 < float(done.stdout) < 1000, done.stdout


def test_config_refuses_a_decode_of_one_token():
    with pytest.raises(ValueError, match="new_tokens"):
        DecodeBenchConfig(new_tokens=1)


# --- the loader adapter -------------------------------------------------------------------------


class _Loaded:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.tokenizer = model, object()


@pytest.mark.parametrize("weights", [None, "int8"])
def test_the_adapter_passes_weights_to_a_loader_that_takes_them(monkeypatch, weights):
    calls = []

    def load(source, *, device="cpu", dtype=None, weights=None):
        calls.append((source, weights))
        return _Loaded(inference_model(tiny_decoder(), weights or "bf16"))

    monkeypatch.setattr(dikkat.pretrained, "load", load)
    model, _ = _load("tiny", weights)
    assert calls == [("tiny", weights)]
    held = {m.weights_format for m in model.modules() if hasattr(m, "weights_format")}
    assert held == {weights or "bf16"}  # the loader's copy, as it is


@pytest.mark.parametrize("weights", [None, "int8"])
def test_a_plain_model_is_copied_once_into_its_format(monkeypatch, weights):
    """A loader's plain model (an HF folder's fp32 weights) becomes an inference copy here, so
    that the repetitions do not each make their own."""

    def load(source, *, device="cpu", dtype=None, weights=None):
        return _Loaded(tiny_decoder())

    monkeypatch.setattr(dikkat.pretrained, "load", load)
    model, _ = _load("tiny", weights)
    held = {m.weights_format for m in model.modules() if hasattr(m, "weights_format")}
    assert held == {weights or "fp32"}


def test_an_unknown_format_is_refused_before_loading():
    with pytest.raises(ValueError, match="q9"):
        _load("no-such-model", "q9")  # the format is named, not the missing model


# --- the command line ---------------------------------------------------------------------------


def test_json_holds_every_figure_and_one_entry_per_repetition(tiny, capsys):
    threads = torch.get_num_threads()
    argv = ["bench", "decode", str(tiny), *SMALL_RUN, *FAST, "--repeat", "2", "--json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    result = json.loads(out)  # stdout is the JSON object alone; progress went to stderr
    assert "repetition 2/2" in err and "loading" in err
    for key in ("decode_tok_s", "prefill_tok_s", "decode_tokens"):
        assert len(result[key]) == 2, key
    assert all(v > 0 for v in result["decode_tok_s"] + result["prefill_tok_s"])
    assert result["decode_tokens"] == [4, 4]
    assert result["read_gb_s"] > 0 and result["peak_rss_mb"] > 0 and result["bandwidth_share"] > 0
    assert result["load_s"] > 0 and result["first_token_s"] > 0
    assert "loaded in" in err
    assert (result["model"], result["weights"], result["threads"]) == (str(tiny), "fp32", 1)
    assert (result["prompt_tokens"], result["new_tokens"], result["prefill_tokens"]) == (4, 4, 8)
    assert result["repeat"] == 2 and result["torch"] == torch.__version__ and result["cpu"]
    # 4 prompt tokens, 4 new: the three timed steps attend over 5, 6 and 7 keys
    kv = 2 * TINY.n_layers * TINY.kv_heads * TINY.dim * 4 * 6
    assert result["weight_bytes"] == hand_count(TINY, "fp32")
    assert result["bytes_per_token"] == hand_count(TINY, "fp32") + kv
    assert torch.get_num_threads() == threads  # restored


def test_a_compiled_decode_is_checked_against_the_eager_one(tiny, capsys):
    argv = ["bench", "decode", str(tiny), *SMALL_RUN, *FAST, "--repeat", "1", "--compile"]
    code, out, err = run_cli([*argv, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["compiled_agrees"] == 4  # all 4 tokens: the eager model's
    assert "the eager model's first 4" in err
    code, out, err = run_cli([*argv[:-1], "--json"], capsys)
    assert json.loads(out)["compiled_agrees"] is None  # not compiled, nothing compared


def test_the_table_names_the_model_and_every_repetition(tiny, capsys):
    argv = ["bench", "decode", str(tiny), *SMALL_RUN, *FAST, "--repeat", "1", "--weights", "int8"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert str(tiny) in out and "int8" in out
    for label in ("decode tok/s", "prefill tok/s", "rep 1", "median", "bytes/token", "GB/s",
                  "first token"):  # fmt: skip
        assert label in out, label
    assert f"{hand_count(TINY, 'int8') / 1e6:.2f}" in out  # the weights' MB


def test_decoding_runs_past_eos(eos_first, capsys):
    lm = dikkat.pretrained.load(eos_first)
    prompt = [5, 6, 7, 8]
    stops = tuple(sorted(lm.tokenizer.eos_ids))
    assert EOS in stops
    # the model's own generation ends at once: its greedy token is EOS
    assert generate(lm.model, [prompt], SamplingParams(4, stop_ids=stops)) == [[*prompt, EOS]]
    argv = ["bench", "decode", str(eos_first), *SMALL_RUN, *FAST, "--repeat", "1", "--json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert json.loads(out)["decode_tokens"] == [4]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt-tokens", "30", "--new-tokens", "8"], "38 positions, past the context"),
        (["--prefill-tokens", "33"], "33 prefill tokens are past the context"),
        (["--new-tokens", "1"], "at least 2"),
        (["--repeat", "0"], "positive integer"),
        (["--weights", "q9"], "q9"),
    ],
)
def test_bad_values_are_one_line(tiny, capsys, flags, message):
    code, out, err = run_cli(["bench", "decode", str(tiny), *SMALL_RUN, *FAST, *flags], capsys)
    assert code == 2 and out == ""
    assert_one_error_line(err, message)


def test_an_unknown_model_is_one_line(tmp_path, capsys):
    code, out, err = run_cli(["bench", "decode", str(tmp_path / "nothing"), *FAST], capsys)
    assert code == 2 and out == ""
    assert_one_error_line(err, "no model")


def assert_one_error_line(err: str, message: str) -> None:
    """The error is one line, the last (progress lines may come before it)."""
    lines = err.splitlines()
    assert lines and lines[-1].startswith("dikkat: error:") and message in lines[-1], err
    assert sum("error" in line for line in lines) == 1, err
