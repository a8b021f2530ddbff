"""The built-in numbers → words translation task: words, tokenizer, splits, sampler, exact match."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
import torch

from dikkat.tasks.translate import (
    BOS_ID,
    EOS_ID,
    MAX_TGT_LEN,
    PAD_ID,
    SPECIALS,
    TOKENS,
    NumberTokenizer,
    encode_numbers,
    encode_pairs,
    exact_match,
    exclude_mask,
    make_splits,
    number_to_words,
    sample_batch,
    sample_numbers,
)
from dikkat.text import ByteTokenizer, load_tokenizer

# ---------------------------------------------------------------- an independent reader of words

# fmt: off
ONES = {w: i for i, w in enumerate((
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen",
))}
TENS = {w: 10 * (i + 2) for i, w in enumerate((
    "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
))}
# fmt: on


def read_below_1000(words: list[str]) -> int:
    """A strict reader of 1..999: [U hundred] [T | T-U | U]; no "zero", no "and"."""
    value, rest = 0, list(words)
    if len(rest) >= 2 and rest[1] == "hundred":
        assert rest[0] in ONES and 1 <= ONES[rest[0]] <= 9, words
        value, rest = 100 * ONES[rest[0]], rest[2:]
    if not rest:
        assert value, words  # an empty group
        return value
    assert len(rest) == 1, words
    word = rest[0]
    if "-" in word:  # only tens-units pairs are hyphenated
        tens, units = word.split("-")
        assert tens in TENS and units in ONES and 1 <= ONES[units] <= 9, words
        return value + TENS[tens] + ONES[units]
    if word in TENS:
        return value + TENS[word]
    assert word in ONES and ONES[word] > 0, words  # "zero" only alone (words_to_number)
    return value + ONES[word]


def words_to_number(text: str) -> int:
    assert text == " ".join(text.split()), f"stray spaces in {text!r}"
    words = text.split(" ")
    if "thousand" in words:
        i = words.index("thousand")
        high, low = words[:i], words[i + 1 :]
        assert high, text
        return 1000 * read_below_1000(high) + (read_below_1000(low) if low else 0)
    if words == ["zero"]:
        return 0
    return read_below_1000(words)


SOME_NUMBERS = sorted(
    {*range(1000), *random.Random(0).sample(range(1_000_000), 5000)}
    | {1000, 1001, 1005, 1010, 1100, 10_000, 20_020, 100_000, 100_100, 999_000, 999_999}
)


# ------------------------------------------------------------------------------ number_to_words


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (0, "zero"),
        (7, "seven"),
        (15, "fifteen"),
        (20, "twenty"),
        (21, "twenty-one"),
        (99, "ninety-nine"),
        (100, "one hundred"),
        (110, "one hundred ten"),
        (1000, "one thousand"),
        (1005, "one thousand five"),
        (4721, "four thousand seven hundred twenty-one"),
        (20_000, "twenty thousand"),
        (100_001, "one hundred thousand one"),
        (999_999, "nine hundred ninety-nine thousand nine hundred ninety-nine"),
    ],
)
def test_number_to_words_examples(n: int, words: str) -> None:
    assert number_to_words(n) == words


def test_number_to_words_round_trips_through_an_independent_reader() -> None:
    for n in SOME_NUMBERS:
        assert words_to_number(number_to_words(n)) == n, n


def test_number_to_words_uses_only_the_vocabulary_and_hyphens_only_for_21_to_99() -> None:
    vocab = set(TOKENS[len(SPECIALS) :])
    for n in SOME_NUMBERS:
        text = number_to_words(n)
        pieces = text.replace("-", " - ").split()
        assert set(pieces) <= vocab, text
        tail = n % 100
        assert ("-" in text) == any(
            part % 10 > 0 and 21 <= part % 100 <= 99 for part in (n // 1000, tail)
        ), text
        assert "and" not in pieces


@pytest.mark.parametrize("bad", [-1, 1_000_000, 10**9])
def test_number_to_words_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match=r"n must be in 0\.\.999,999"):
        number_to_words(bad)


@pytest.mark.parametrize("bad", [True, 1.0, "5", None])
def test_number_to_words_refuses_non_ints(bad: object) -> None:
    with pytest.raises(TypeError, match="n must be an int"):
        number_to_words(bad)  # type: ignore[arg-type]


def test_number_to_words_takes_numpy_and_torch_integers() -> None:
    assert number_to_words(np.int64(21)) == number_to_words(torch.tensor(21)) == "twenty-one"


# -------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_layout() -> None:
    tok = NumberTokenizer()
    assert TOKENS[:4] == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert TOKENS[4:14] == tuple("0123456789")
    assert tok.vocab_size == len(TOKENS) == len(set(TOKENS)) == 45
    assert tok.encode("4721") == [4 + 4, 4 + 7, 4 + 2, 4 + 1]
    assert tok.encode("twenty-one") == [TOKENS.index(w) for w in ("twenty", "-", "one")]
    assert tok.encode("") == []


def test_tokenizer_unknown_pieces_and_decoding_rules() -> None:
    tok = NumberTokenizer()
    assert tok.encode("twenty and one") == [TOKENS.index("twenty"), 3, TOKENS.index("one")]
    assert tok.encode("Twenty") == [3]  # case matters: the vocabulary is lower case
    ids = [BOS_ID, *tok.encode("one hundred twenty-one"), EOS_ID, PAD_ID, PAD_ID, 3, 999, -1]
    assert tok.decode(ids) == "one hundred twenty-one"  # specials and out-of-range ids dropped
    assert tok.decode(tok.encode("  4 7 ")) == "47"  # digits glue to digits


def test_tokenizer_round_trips() -> None:
    tok = NumberTokenizer()
    for n in SOME_NUMBERS:
        words = number_to_words(n)
        assert tok.decode(tok.encode(words)) == words
        assert tok.decode(tok.encode(str(n))) == str(n)
        assert 3 not in tok.encode(words)


def test_tokenizer_save_load(tmp_path) -> None:
    tok = NumberTokenizer()
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config == {"type": "number-words", "tokens": list(TOKENS)}
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer_config.json"]  # no temp file left
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, NumberTokenizer)
    assert loaded.encode("4721 forty-two") == tok.encode("4721 forty-two")


def test_load_tokenizer_refuses_a_different_vocabulary(tmp_path) -> None:
    config = {"type": "number-words", "tokens": [*TOKENS, "million"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json holds a number-words vocabulary"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"type": "number-wo')
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_gives_bytes_only_when_recorded(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_tokenizer(tmp_path)  # never a guess: ids of another tokenizer are silently wrong
    ByteTokenizer().save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    (tmp_path / "tokenizer_config.json").write_text('{"type": "words"}')
    with pytest.raises(ValueError, match="names no tokenizer dikkat knows"):
        load_tokenizer(tmp_path)


# --------------------------------------------------------------------------------------- splits


def test_make_splits() -> None:
    split = make_splits(seed=0)
    heldout, val = split  # unpacks
    assert len(heldout) == len(set(heldout)) == 1000
    assert len(val) == len(set(val)) == 1000
    assert not set(heldout) & set(val)
    assert all(0 <= n <= 999_999 for n in (*heldout, *val))
    assert list(heldout) == sorted(heldout)
    assert make_splits(seed=0) == split
    assert make_splits(seed=1).heldout != heldout
    assert int(split.exclude.sum()) == 2000 and bool(split.exclude[heldout[0]])
    small = make_splits(seed=3, n_heldout=5, n_val=0)
    assert len(small.heldout) == 5 and small.val == ()
    # uniform draw: the held-out numbers spread over the whole range
    assert np.mean(heldout) == pytest.approx(500_000, rel=0.1)


def test_make_splits_errors() -> None:
    with pytest.raises(ValueError, match="n_val must be ≥ 0"):
        make_splits(n_val=-1)
    with pytest.raises(TypeError, match="n_heldout must be an int"):
        make_splits(n_heldout=10.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="leaves nothing"):
        make_splits(n_heldout=600_000, n_val=400_000)


# -------------------------------------------------------------------------------------- batches


def check_layout(src: torch.Tensor, tgt: torch.Tensor, numbers: list[int]) -> None:
    """Source = digits then padding; target = <bos> words <eos> then padding; as ``numbers``."""
    tok = NumberTokenizer()
    assert src.dtype == tgt.dtype == torch.long
    assert src.shape[0] == tgt.shape[0] == len(numbers)
    assert src.shape[1] == max(len(str(n)) for n in numbers)  # padded to the longest row only
    assert tgt.shape[1] <= MAX_TGT_LEN
    for s, t, n in zip(src.tolist(), tgt.tolist(), numbers, strict=True):
        digits = str(n)
        assert s == tok.encode(digits) + [PAD_ID] * (len(s) - len(digits))
        words = tok.encode(number_to_words(n))
        assert t == [BOS_ID, *words, EOS_ID] + [PAD_ID] * (len(t) - len(words) - 2)


def test_encode_pairs_and_encode_numbers() -> None:
    numbers = [0, 7, 21, 4721, 999_999, 100_000]
    src, tgt = encode_pairs(numbers)
    check_layout(src, tgt, numbers)
    assert torch.equal(encode_numbers(numbers), src)
    assert torch.equal(encode_pairs(torch.tensor(numbers))[1], tgt)
    with pytest.raises(ValueError, match="numbers is empty"):
        encode_pairs([])
    with pytest.raises(ValueError, match=r"numbers\[1\] must be in"):
        encode_numbers([5, -5])


def test_sample_batch_layout_and_determinism() -> None:
    split = make_splits()
    a = sample_batch(64, torch.Generator().manual_seed(5), split.exclude)
    b = sample_batch(64, torch.Generator().manual_seed(5), split.exclude)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    tok = NumberTokenizer()
    numbers = [int(tok.decode(row)) for row in a[0].tolist()]
    check_layout(*a, numbers)
    g = torch.Generator().manual_seed(5)
    sample_batch(64, g, split.exclude)
    later = sample_batch(64, g, split.exclude)[0]  # the generator moves on
    assert [int(tok.decode(row)) for row in later.tolist()] != numbers
    # a set of numbers gives the same batch as the mask
    d = sample_batch(64, torch.Generator().manual_seed(5), {*split.heldout, *split.val})
    assert torch.equal(a[1], d[1])


def test_sampler_never_draws_excluded_numbers() -> None:
    split = make_splits()
    # also exclude most small numbers, where the log-uniform half draws often: a leak shows fast
    extra = [n for n in range(1000) if n % 7]
    exclude = exclude_mask([*split.heldout, *split.val, *extra])
    g = torch.Generator().manual_seed(0)
    drawn = torch.cat([sample_numbers(512, g, exclude) for _ in range(400)])  # 204,800 numbers
    assert not bool(exclude[drawn].any())
    assert int((drawn < 1000).sum()) > 1000  # the small numbers left (multiples of 7) do come
    # the sampler's own view of the batch holds no excluded number either
    tok = NumberTokenizer()
    for _ in range(20):
        src, _tgt = sample_batch(64, g, exclude)
        assert not any(exclude[int(tok.decode(r))] for r in src.tolist())


def test_sampler_mixes_magnitudes() -> None:
    drawn = sample_numbers(20_000, torch.Generator().manual_seed(1), [])
    digits = torch.tensor([len(str(n)) for n in drawn.tolist()])
    share = torch.bincount(digits, minlength=7)[1:].double() / len(drawn)
    # half uniform (90% six digits), half one-sixth per digit count
    expected = torch.tensor([0, 0, 0.0009, 0.009, 0.09, 0.9]).double() / 2 + 1 / 12
    assert torch.allclose(share, expected, atol=0.015), share
    assert len(set(drawn[drawn < 10].tolist())) == 10  # every single digit, zero included


def test_sampler_errors() -> None:
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        sample_batch(0, g, [])
    with pytest.raises(TypeError, match="batch_size must be an int"):
        sample_batch(2.0, g, [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nothing left to train on"):
        sample_batch(4, g, torch.ones(1_000_000, dtype=torch.bool))
    with pytest.raises(ValueError, match="exclude mask must have shape"):
        sample_batch(4, g, torch.zeros(10, dtype=torch.bool))
    with pytest.raises(ValueError, match="exclude must hold numbers in"):
        sample_batch(4, g, [1_000_000])
    with pytest.raises(TypeError, match="exclude must hold ints"):
        sample_batch(4, g, [1.5])


def test_sampler_is_fast() -> None:
    split = make_splits()
    g = torch.Generator().manual_seed(0)
    sample_batch(64, g, split.exclude)  # warm up
    times = []
    for _ in range(20):
        start = time.perf_counter()
        sample_batch(64, g, split.exclude)
        times.append(time.perf_counter() - start)
    assert min(times) < 0.005, f"{min(times) * 1e3:.2f} ms for a batch of 64"


# ---------------------------------------------------------------------------------- exact match


class FakeTranslator:
    """Reads the digits back and answers right for even numbers, wrongly for odd ones."""

    def __init__(self) -> None:
        self.tok = NumberTokenizer()
        self.calls: list[dict] = []

    def generate(self, src, max_new_tokens, *, bos_id, eos_id=None, pad_id=0):
        self.calls.append(
            {"rows": len(src), "max_new_tokens": max_new_tokens, "ids": (bos_id, eos_id, pad_id)}
        )
        out = []
        for row in src:
            n = int(self.tok.decode(row))
            words = self.tok.encode(number_to_words(n))
            if n % 4 == 1:  # wrong words
                words = self.tok.encode(number_to_words((n + 1) % 1_000_000))
            elif n % 4 == 3:  # right words, then a stray <unk> that decode alone would hide
                words = [*words, 3]
            elif n % 8 == 2:  # right, but stopped without <eos> (allowed)
                out.append(words)
                continue
            out.append([*words, eos_id, eos_id])  # generate repeats eos after the end
        return out


def test_exact_match_with_a_fake_model() -> None:
    numbers = [*range(0, 40), 999_998, 999_999, 4721, 100_000]
    model = FakeTranslator()
    got = exact_match(model, numbers, NumberTokenizer(), batch_size=7)
    assert got == pytest.approx(sum(n % 2 == 0 for n in numbers) / len(numbers))
    assert [c["rows"] for c in model.calls] == [7] * 6 + [2]
    assert all(c["ids"] == (BOS_ID, EOS_ID, PAD_ID) for c in model.calls)
    assert all(c["max_new_tokens"] >= MAX_TGT_LEN - 1 for c in model.calls)  # words + <eos>
    with pytest.raises(ValueError, match="batch_size must be positive"):
        exact_match(model, numbers, NumberTokenizer(), batch_size=0)


def test_exact_match_runs_a_real_seq2seq() -> None:
    from dikkat.models.seq2seq import Seq2Seq, Seq2SeqConfig

    tok = NumberTokenizer()
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=tok.vocab_size,
        tgt_vocab_size=tok.vocab_size,
        max_len=32,
        d_model=16,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
    )
    score = exact_match(Seq2Seq(config), [0, 5, 4721, 999_999], tok, batch_size=3)
    assert 0.0 <= score <= 1.0  # untrained: the point is that ids and shapes fit generate
