"""Damaged and hostile GGUF files are refused at load, in one line naming the file and the key or
tensor — never loaded into a model that answers NaN or garbage, never a hang, never a traceback
from deep inside torch or tokenizers (docs/models.md, "What a load checks").

Each file is the tiny Llama of tiny_gguf.py with one thing wrong; the last tests damage the real
SmolLM2 file the same way.
"""

from __future__ import annotations

import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import (
    ARRAY,
    F32,
    I32,
    STRING,
    T_BF16,
    T_F16,
    T_F32,
    U32,
    Key,
    byte_level_vocab,
    prompt_ids,
    tiny_llama,
    tiny_llama_file,
    write,
)

import dikkat
from dikkat.pretrained import GGUFFile
from dikkat.pretrained.tokenizer import Tokenizer

pytest.importorskip("gguf")

NAN16, INF16 = np.float16("nan").tobytes(), np.float16("inf").tobytes()


def refused(path: Path, *words: str, weights: str | None = None, within: float = 5.0) -> str:
    """Load ``path``; it must be refused with one line naming the file and each of ``words``,
    in under ``within`` seconds."""
    start = time.perf_counter()
    with pytest.raises((ValueError, TypeError)) as caught:
        dikkat.pretrained.load(path, weights=weights)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message and len(message) < 600, message
    assert str(path) in message, message
    for word in words:
        assert word in message, (word, message)
    assert time.perf_counter() - start < within, message
    return message


def damaged(tmp_path: Path, change, **options) -> Path:
    """The tiny model's file with ``change(bytearray, layout)`` applied to its bytes."""
    data, layout = write(*tiny_llama(**options))
    data = bytearray(data)
    change(data, layout)
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    return path


def put(data: bytearray, at: int, fmt: str, value) -> None:
    struct.pack_into(fmt, data, at, value)


def test_the_undamaged_tiny_model_loads_and_answers(tmp_path):
    """The baseline every refusal below departs from: the file loads, its logits are finite,
    and its sizes agree (config, embedding rows, tokenizer)."""
    path = tmp_path / "tiny.gguf"
    tiny_llama_file(path)
    lm = dikkat.pretrained.load(path)
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt_ids()]))
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert lm.model.config.vocab_size == lm.tokenizer.vocab_size == len(byte_level_vocab()[0])
    fp32 = dikkat.pretrained.load(path, weights="fp32")
    with torch.no_grad():  # the packed product rounds activations to 16 bits a block of 32
        worst = (fp32.model(torch.tensor([prompt_ids()])) - logits).abs().max()
        assert worst <= 1e-3 * logits.abs().max()


# ------------------------------------------------------------------ non-finite weights


@pytest.mark.parametrize("bad", [NAN16, INF16], ids=["nan", "inf"])
@pytest.mark.parametrize("weights", [None, "fp32"])
def test_a_non_finite_block_scale_is_refused(tmp_path, bad, weights):
    def change(data, layout):
        at = layout.tensors["blk.0.attn_q.weight"]["data"]  # row 0, block 0: its fp16 d
        data[at : at + 2] = bad

    refused(damaged(tmp_path, change), "blk.0.attn_q.weight", "row 0", weights=weights)


def test_a_non_finite_block_minimum_is_refused(tmp_path):
    def change(data, layout):
        at = layout.tensors["blk.1.ffn_gate.weight"]["data"] + 3 * 40 + 20 + 2  # row 3, block 1
        data[at : at + 2] = NAN16  # Q4_1: d, then m

    refused(damaged(tmp_path, change), "blk.1.ffn_gate.weight", "row 3", "block 1")


def test_a_nan_scale_in_an_embedding_row_is_refused(tmp_path):
    def change(data, layout):
        at = layout.tensors["token_embd.weight"]["data"] + 5 * 68  # Q8_0: 2 blocks of 34 a row
        data[at : at + 2] = NAN16

    refused(damaged(tmp_path, change), "token_embd.weight", "row 5")


@pytest.mark.parametrize("kind", [T_F32, T_F16, T_BF16], ids=["F32", "F16", "BF16"])
def test_a_nan_in_a_float_tensor_is_refused(tmp_path, kind):
    name = "blk.1.attn_output.weight"
    width = {T_F32: 4, T_F16: 2, T_BF16: 2}[kind]
    nan = {T_F32: np.float32("nan").tobytes(), T_F16: NAN16, T_BF16: b"\xc0\x7f"}[kind]

    def change(data, layout):
        at = layout.tensors[name]["data"] + (7 * 64 + 9) * width  # row 7, column 9
        data[at : at + width] = nan

    refused(damaged(tmp_path, change, kinds={name: kind}), name, "row 7")
    refused(damaged(tmp_path, change, kinds={name: kind}), name, weights="fp32")


@pytest.mark.parametrize("kind", [T_F16, T_BF16], ids=["F16", "BF16"])
def test_a_float_type_id_over_quantised_bytes_is_refused(tmp_path, kind):
    """F16 or BF16 written over a Q4_1 tensor's type: its bytes are now too few for its shape,
    so it runs into the next tensor."""

    def change(data, layout):
        put(data, layout.tensors["blk.0.attn_q.weight"]["type"], "<I", kind)

    refused(damaged(tmp_path, change), "blk.0.attn_q.weight")


def test_an_integer_type_over_a_float_tensor_is_refused(tmp_path):
    def change(data, layout):  # I32 has F32's size: only its type can refuse it
        put(data, layout.tensors["blk.0.attn_norm.weight"]["type"], "<I", 26)

    refused(damaged(tmp_path, change), "blk.0.attn_norm.weight", "I32")


# ------------------------------------------------------------------ the tensor directory


def test_a_tensor_pointing_at_another_s_bytes_is_refused(tmp_path):
    def change(data, layout):
        other = layout.tensors["blk.1.attn_q.weight"]["data"] - layout.data_start
        put(data, layout.tensors["blk.0.attn_q.weight"]["offset"], "<Q", other)

    refused(damaged(tmp_path, change), "blk.0.attn_q.weight")


def test_a_tensor_starting_inside_another_is_refused(tmp_path):
    def change(data, layout):
        at = layout.tensors["blk.0.attn_k.weight"]["offset"]
        put(data, at, "<Q", struct.unpack_from("<Q", data, at)[0] - 64)  # aligned, overlapping

    refused(damaged(tmp_path, change), "blk.0.attn_k.weight", "overlaps")


def test_an_unaligned_offset_is_refused(tmp_path):
    def change(data, layout):
        at = layout.tensors["blk.0.attn_k.weight"]["offset"]
        put(data, at, "<Q", struct.unpack_from("<Q", data, at)[0] + 4)

    refused(damaged(tmp_path, change), "blk.0.attn_k.weight", "alignment")


def test_a_tensor_listed_twice_is_refused(tmp_path):
    keys, tensors = tiny_llama()
    twin = next(t for t in tensors if t.name == "blk.1.attn_norm.weight")
    tensors[tensors.index(next(t for t in tensors if t.name == "blk.0.attn_norm.weight"))] = twin
    path = tmp_path / "twice.gguf"
    path.write_bytes(write(keys, tensors)[0])
    refused(path, "blk.1.attn_norm.weight", "twice")


def test_a_key_listed_twice_is_refused(tmp_path):
    keys, tensors = tiny_llama()
    keys.append(Key("llama.embedding_length", U32, 64))
    path = tmp_path / "twice.gguf"
    path.write_bytes(write(keys, tensors)[0])
    refused(path, "llama.embedding_length", "twice")


def test_bytes_after_the_last_tensor_are_refused(tmp_path):
    """The last tensor's type made smaller (F32 → F16) leaves half its bytes unread: the data
    section no longer ends where the file does."""

    def change(data, layout):
        put(data, layout.tensors["output_norm.weight"]["type"], "<I", T_F16)

    refused(damaged(tmp_path, change), "output_norm.weight")


def test_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_llama_file(path)
    data = path.read_bytes()
    for keep in (30, 200, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:keep])
        refused(path)


# ------------------------------------------------------------------ bounds before allocation


def test_n_dims_past_ggml_s_four_is_refused_at_once(tmp_path):
    for n_dims in (5, 2**31):

        def change(data, layout, n_dims=n_dims):
            put(data, layout.tensors["blk.0.attn_q.weight"]["n_dims"], "<I", n_dims)

        refused(damaged(tmp_path, change), "blk.0.attn_q.weight", "dimensions", within=3)


def test_dims_whose_product_overflows_are_refused(tmp_path):
    def change(data, layout):
        at = layout.tensors["blk.0.attn_q.weight"]["dims"]
        put(data, at, "<Q", 2**32)  # 2**32 × 2**32 values: past int64
        put(data, at + 8, "<Q", 2**32)

    refused(damaged(tmp_path, change), "blk.0.attn_q.weight", within=3)


def test_a_negative_dim_is_refused(tmp_path):
    def change(data, layout):
        put(data, layout.tensors["output_norm.weight"]["dims"], "<q", -64)

    refused(damaged(tmp_path, change), "output_norm.weight", within=3)


def test_block_count_is_checked_against_the_tensors_at_once(tmp_path):
    for count in (10**9, 3, 1):
        header = {"llama.block_count": Key("llama.block_count", U32, count)}
        path = tmp_path / "blocks.gguf"
        tiny_llama_file(path, header=header)
        refused(path, "llama.block_count", str(count), within=3)


def test_an_array_nested_deep_is_refused_without_recursion(tmp_path):
    depth = 10**5
    nested = struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U32, 0)
    keys, tensors = tiny_llama()
    data, layout = write(keys, tensors)
    at = layout.keys["general.alignment"]["key"]  # a new first key, its value the nested array
    blob = struct.pack("<Q", 4) + b"deep" + struct.pack("<I", ARRAY) + nested
    data = bytearray(data[:at] + blob + data[at:])
    put(data, layout.counts + 8, "<Q", len(keys) + 1)
    path = tmp_path / "deep.gguf"
    path.write_bytes(bytes(data))
    refused(path, "'deep'", "nested", within=3)


@pytest.mark.parametrize("field", ["key name", "string value", "array count"])
def test_a_huge_length_is_refused_before_allocating(tmp_path, field):
    def change(data, layout):
        where = layout.keys["tokenizer.ggml.merges"]
        at = {"key name": where["key"], "string value": layout.keys["general.architecture"][
            "value"], "array count": where["value"] + 4}[field]  # fmt: skip
        put(data, at, "<Q", 2**62)

    refused(damaged(tmp_path, change), within=3)


@pytest.mark.parametrize("which", ["tensors", "keys"])
def test_a_huge_count_is_refused_at_once(tmp_path, which):
    def change(data, layout):
        put(data, layout.counts + (0 if which == "tensors" else 8), "<Q", 2**60)

    refused(damaged(tmp_path, change), which, within=3)


@pytest.mark.parametrize("value", [7, 0, 48])
def test_an_alignment_that_is_no_power_of_two_is_refused(tmp_path, value):
    header = {"general.alignment": Key("general.alignment", U32, value)}
    path = tmp_path / "aligned.gguf"
    tiny_llama_file(path, header=header)
    refused(path, "general.alignment", str(value))


def test_an_alignment_of_another_type_is_refused(tmp_path):
    header = {"general.alignment": Key("general.alignment", STRING, "32")}
    path = tmp_path / "aligned.gguf"
    tiny_llama_file(path, header=header)
    refused(path, "general.alignment")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llama.attention.head_count", Key("", STRING, "4")),
        ("llama.attention.head_count", Key("", U32, 0)),
        ("llama.attention.head_count_kv", Key("", U32, 3)),
        ("llama.embedding_length", Key("", U32, 2**31 + 5)),
        ("llama.feed_forward_length", Key("", U32, 128)),
        ("llama.context_length", Key("", ARRAY, [1, 2], U32)),
        ("llama.attention.layer_norm_rms_epsilon", Key("", F32, float("nan"))),
        ("llama.rope.freq_base", Key("", F32, -1.0)),
        ("llama.rope.dimension_count", Key("", U32, 6)),
    ],
)
def test_a_size_of_the_wrong_type_or_range_is_refused_naming_its_key(tmp_path, key, value):
    value.name = key
    path = tmp_path / "sizes.gguf"
    tiny_llama_file(path, header={key: value})
    refused(path, key, within=3)


def test_a_reshaped_tensor_is_refused_naming_both_shapes(tmp_path):
    """attn_q stored as (128, 32) instead of (64, 64): the same bytes, another shape."""

    def change(data, layout):
        at = layout.tensors["blk.1.attn_q.weight"]["dims"]
        put(data, at, "<Q", 32)  # fastest first: 32 values a row
        put(data, at + 8, "<Q", 128)

    message = refused(damaged(tmp_path, change), "blk.1.attn_q.weight")
    assert "(64, 64)" in message and "(128, 32)" in message, message


# ------------------------------------------------------------------ vocabulary


def test_a_header_vocab_size_past_the_embedding_is_refused(tmp_path):
    header = {"llama.vocab_size": Key("llama.vocab_size", U32, 60000)}
    path = tmp_path / "vocab.gguf"
    tiny_llama_file(path, header=header)
    refused(path, "llama.vocab_size", "60000", "token_embd.weight")


def test_a_token_list_that_is_not_one_token_a_row_is_refused(tmp_path):
    tokens, types, _ = byte_level_vocab()
    header = {
        "tokenizer.ggml.tokens": Key("tokenizer.ggml.tokens", ARRAY, tokens[:-1], STRING),
        "tokenizer.ggml.token_type": Key("tokenizer.ggml.token_type", ARRAY, types[:-1], I32),
    }
    path = tmp_path / "vocab.gguf"
    tiny_llama_file(path, header=header)
    refused(path, "tokenizer.ggml.tokens", "token_embd.weight")


def test_merges_of_tokens_the_list_lacks_are_refused(tmp_path):
    """A merged token renamed (the list as long as before): tokenizers would fail with a bare
    'Exception: Error while initializing BPE'."""
    tokens, _, merges = byte_level_vocab()
    tokens[tokens.index("the")] = "thX"
    header = {"tokenizer.ggml.tokens": Key("tokenizer.ggml.tokens", ARRAY, tokens, STRING)}
    path = tmp_path / "vocab.gguf"
    tiny_llama_file(path, header=header)
    refused(path, "tokenizer.ggml.merges", "'the'")
    meta = GGUFFile(path).metadata
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf_metadata(meta)
    assert "th e" in merges


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tokenizer.ggml.bos_token_id", Key("", U32, 5000)),
        ("tokenizer.ggml.eos_token_id", Key("", STRING, "1")),
        ("tokenizer.ggml.padding_token_id", Key("", I32, -1)),
        ("tokenizer.ggml.merges", Key("", ARRAY, [1, 2], U32)),
        ("tokenizer.ggml.pre", Key("", ARRAY, [1], U32)),
        ("tokenizer.ggml.token_type", Key("", U32, 1)),
    ],
)
def test_a_tokenizer_key_of_the_wrong_type_or_range_is_refused(tmp_path, key, value):
    value.name = key
    path = tmp_path / "tokens.gguf"
    tiny_llama_file(path, header={key: value})
    refused(path, key)


# ------------------------------------------------------------------ a GPT-2 file


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("gpt2.block_count", 10**9, ("gpt2.block_count", "1000000000")),
        ("gpt2.context_length", 0, ("gpt2.context_length",)),
        ("gpt2.embedding_length", 48, ("token_embd.weight", "(256, 32)")),
    ],
)
def test_a_gpt2_file_s_sizes_are_checked_too(tmp_path, key, value, words):
    from dikkat.interop import write_gguf
    from dikkat.models import GPT, GPTConfig
    from dikkat.text import ByteTokenizer

    config = GPTConfig(vocab_size=256, d_model=32, n_heads=4, n_layers=2, max_len=64)
    path = write_gguf(GPT(config), ByteTokenizer(), tmp_path / "gpt.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == U32
    put(data, at + 4, "<I", value)
    path.write_bytes(bytes(data))
    refused(path, *words)


# ------------------------------------------------------------------ the real file, damaged


def real_copy(smollm2_gguf: Path, tmp_path: Path) -> tuple[Path, bytearray]:
    path = tmp_path / "smollm2.gguf"
    shutil.copyfile(smollm2_gguf, path)
    return path, bytearray(path.read_bytes())


def test_smollm2_with_a_nan_scale_is_refused(smollm2_gguf, tmp_path):
    path, data = real_copy(smollm2_gguf, tmp_path)
    at = GGUFFile(smollm2_gguf).tensors["blk.0.attn_q.weight"].offset
    data[at : at + 2] = NAN16
    path.write_bytes(bytes(data))
    refused(path, "blk.0.attn_q.weight", "row 0", "block 0", within=10)


def test_smollm2_with_a_vocab_size_past_its_embedding_is_refused(smollm2_gguf, tmp_path):
    path, data = real_copy(smollm2_gguf, tmp_path)
    key = b"llama.vocab_size"
    at = data.index(key) + len(key)
    assert struct.unpack_from("<II", data, at) == (U32, 49152)
    put(data, at + 4, "<I", 60000)
    path.write_bytes(bytes(data))
    refused(path, "llama.vocab_size", "60000", "49152", within=10)
