"""A dikkat run's tokenizer as a GGUF ``gpt2`` vocabulary: through the file and
``Tokenizer.from_gguf_metadata`` (what ``dikkat.pretrained.load`` reads, with llama.cpp's keys),
the same ids as the run's own tokenizer; what has no such vocabulary is refused by name."""

from __future__ import annotations

import json

import pytest
from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as pre

from dikkat.interop import write_gguf
from dikkat.interop.gguf_vocab import CONTROL, NORMAL, USER_DEFINED, byte_symbols, gguf_vocab
from dikkat.models import GPT, GPTConfig
from dikkat.pretrained import GGUFFile
from dikkat.pretrained import Tokenizer as GGUFTokenizer
from dikkat.text import ByteTokenizer, HFTokenizer, NoTokenizer
from dikkat.text.number_words import NumberTokenizer

TEXTS = [
    "def add(a, b):\n    return a + b  # 42\n",
    "Ağaç, şeker, ılık, İstanbul — café naïve",
    "emoji 🦊🎉 and CJK 注意力",
    "   spaces\t\ttabs\n\n\nnewlines 1234567 don't we'll",
]


def through_gguf(tokenizer: object, vocab_size: int, tmp_path) -> GGUFTokenizer:
    """``tokenizer`` written with a tiny GPT of ``vocab_size`` ids, and read back from the file."""
    config = GPTConfig(vocab_size=vocab_size, max_len=8, d_model=8, n_layers=1, n_heads=2)
    path = write_gguf(GPT(config), tokenizer, tmp_path / "m.gguf")
    return GGUFTokenizer.from_gguf_metadata(GGUFFile(path).metadata)


def trained_bpe(special: tuple[str, ...] = ()) -> HFTokenizer:
    tok = ByteLevelBPETokenizer()
    text = "\n".join(TEXTS[:2]) * 20 + json.__doc__
    tok.train_from_iterator([text], vocab_size=400, min_frequency=2, show_progress=False,
                            special_tokens=list(special))  # fmt: skip
    return HFTokenizer(tok)


def test_the_byte_symbols_are_gpt2_s_alphabet():
    symbols = byte_symbols()
    assert len(set(symbols)) == 256
    assert set(symbols) == set(pre.ByteLevel.alphabet())
    assert symbols[ord("a")] == "a" and symbols[ord(" ")] == "Ġ" and symbols[ord("\n")] == "Ċ"
    # each byte's symbol is what the byte-level pre-tokenizer turns that byte into
    level = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    for b in range(128):  # one-byte characters
        assert level.pre_tokenize_str(chr(b))[0][0] == symbols[b], b


def test_the_bytes_tokenizer_reads_back_byte_for_byte(tmp_path):
    back = through_gguf(ByteTokenizer(), 256, tmp_path)
    for text in TEXTS:
        ids = back.encode(text)
        assert ids == ByteTokenizer().encode(text), text
        assert back.decode(ids) == text
    assert back.bos_id is None and back.eos_id is None and not back.add_bos


def test_a_trained_bpe_reads_back_with_the_same_ids(tmp_path):
    bpe = trained_bpe()
    back = through_gguf(bpe, bpe.vocab_size, tmp_path)
    merged = 0
    for text in TEXTS:
        ids = bpe.encode(text)
        assert back.encode(text) == ids, text
        assert back.decode(ids) == text
        merged += len(text.encode()) - len(ids)
    assert merged > 20  # the merges are applied: not a byte-for-byte accident


def test_end_of_text_is_a_control_token_and_bos_eos(tmp_path):
    bpe = trained_bpe(special=("<|endoftext|>",))
    vocab = gguf_vocab(bpe, bpe.vocab_size)
    end = vocab.tokens.index("<|endoftext|>")
    assert vocab.types[end] == CONTROL and vocab.bos_id == vocab.eos_id == end
    assert vocab.types.count(NORMAL) == len(vocab.tokens) - 1
    back = through_gguf(bpe, bpe.vocab_size, tmp_path)
    text = "a + b<|endoftext|>c"
    assert back.encode(text) == bpe.encode(text)  # matched whole, as the run's tokenizer does
    assert end in back.eos_ids


def test_rows_past_the_tokenizer_are_padding_tokens():
    vocab = gguf_vocab(ByteTokenizer(), 260)
    assert vocab.tokens[256:] == ["[PAD256]", "[PAD257]", "[PAD258]", "[PAD259]"]
    assert vocab.types[256:] == [USER_DEFINED] * 4
    with pytest.raises(ValueError, match="256 tokens but the model's embedding only 200 rows"):
        gguf_vocab(ByteTokenizer(), 200)


def _tokenizer_json(**parts: object) -> HFTokenizer:
    """A byte-level BPE with one part replaced."""
    inner = Tokenizer(models.BPE({s: i for i, s in enumerate(byte_symbols())}, []))
    inner.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    for name, value in parts.items():
        setattr(inner, name, value)
    return HFTokenizer(inner)


@pytest.mark.parametrize(
    ("tokenizer", "word"),
    [
        (NumberTokenizer(), "NumberTokenizer has no GGUF"),
        (NoTokenizer(), "NoTokenizer has no GGUF"),
        (HFTokenizer(Tokenizer(models.WordPiece({"[UNK]": 0}))), "'WordPiece' tokenizer"),
        (_tokenizer_json(normalizer=normalizers.Lowercase()), "normalises"),
        (_tokenizer_json(pre_tokenizer=pre.Metaspace()), "pre-tokenizer is not GPT-2's"),
        (_tokenizer_json(pre_tokenizer=pre.ByteLevel(add_prefix_space=True)), "not GPT-2's"),
        (_tokenizer_json(decoder=decoders.Metaspace()), "decoder is not byte-level"),
        (_tokenizer_json(pre_tokenizer=pre.Sequence([pre.Digits(), pre.ByteLevel()])), "GPT-2's"),
    ],
    ids=[
        "numbers",
        "none",
        "wordpiece",
        "normaliser",
        "metaspace",
        "prefix space",
        "decoder",
        "digits first",
    ],
)
def test_what_has_no_gpt2_vocabulary_is_refused(tokenizer, word):
    with pytest.raises(ValueError, match=word):
        gguf_vocab(tokenizer, 10_000)


def test_a_bpe_without_every_byte_is_refused():
    inner = Tokenizer(models.BPE({s: i for i, s in enumerate(byte_symbols()[:200])}, []))
    inner.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    with pytest.raises(ValueError, match="lacks 56 of the 256 byte symbols"):
        gguf_vocab(HFTokenizer(inner), 256)


def test_the_written_bytes_vocabulary_is_complete(tmp_path):
    config = GPTConfig(vocab_size=256, max_len=8, d_model=8, n_layers=1, n_heads=2)
    path = write_gguf(GPT(config), ByteTokenizer(), tmp_path / "m.gguf")
    meta = GGUFFile(path).metadata
    assert meta["tokenizer.ggml.tokens"] == byte_symbols()
    assert meta["tokenizer.ggml.token_type"] == [NORMAL] * 256
