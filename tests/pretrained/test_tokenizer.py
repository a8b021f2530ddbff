"""dikkat's tokenizer against transformers reading the same GGUF file, on the two real models.

The reference is transformers' GGUF tokenizer (``from_pretrained(folder, gguf_file=name)``).
Where it departs from the model's own tokenizer, dikkat follows the model (and llama.cpp), and
the test says so and checks against a second reference instead:

* SmolLM2 (``tokenizer.ggml.pre = "smollm"``): transformers does not know the name and cuts the
  text with GPT-2's expression alone; SmolLM2's ``tokenizer.json`` and llama.cpp first split every
  digit off. The ids differ where a digit follows two or more whitespace characters (``"x  1"``).
  The second reference is transformers' tokenizer with SmolLM2's own pre-tokenizer put back.
* Gemma 3: a run of 32 or more spaces. The file stores the runs of 2-31 spaces as user-defined
  tokens; llama.cpp (and SentencePiece) match the longest run first, transformers rebuilds the
  run from BPE merges of its own and takes 16 + 16. The second reference is
  :func:`_sentencepiece_reference`, the SentencePiece-BPE algorithm written out plainly, which
  checks every text.
* A ``llama`` (SentencePiece) vocabulary with ``tokenizer.ggml.add_space_prefix = False`` and an
  architecture transformers has no builder of its own for: its converter prefixes a space anyway
  (Gemma 3 is not affected: it has its own builder). No real file here has it; a tiny vocabulary
  checks that dikkat follows the flag.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.tokenizer import Tokenizer

TEXTS = {
    "empty": "",
    "english": "Hello, world! How are you doing today?",
    "python": (
        "def area(r: float) -> float:\n"
        '    """The circle\'s area."""\n'
        "\tif r < 0:\n"
        "\t\traise ValueError(r)\n"
        "    return 3.14159 * r ** 2  # πr²\n"
    ),
    "accents": "café naïve über Straße résumé Ångström",
    "emoji": "👍🏽 great 🇹🇷 flag 👨‍👩‍👧 family 😀",
    "turkish": "Ağaç işçisi ılık sütü İstanbul'da içti; çöp, ÖĞRENCİ, şişe, göğüs.",
    "whitespace": "a  b   c    d\t\te \t x  ",
    "newlines": "line one\n\nline two\n\n\n\nend\r\n",
    "digits": "12345 + 678 = 13023, on 2024-01-31, v1.2.3, 0.000001",
    "digits after spaces": "x  1 and\n\n2 and   42\t\t7",
    "chatml": "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "gemma turns": "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "specials": "<bos>text<eos><pad><|endoftext|> <mask>",
    "long word": "pneumonoultramicroscopicsilicovolcanoconiosis" * 12,
    "long space run": " " * 40 + "indented",
    "cjk": "日本語のテキスト、中文文本。한국어 문장",
    "markup": '<div class="x">Hi</div> <0x41> &amp; [multimodal]',
    "contractions": "don't I'll we've they'RE it's",
    "edges": " leading and trailing ",
    "unusual spaces": "\u00a0no-break\u2003em\u200bzero\u3000ideographic",
    "rare characters": "𓀀 ꙮ \U0010fffd \x00\x7f",  # not in Gemma's vocabulary: its bytes
}
IDS = list(TEXTS)

# where transformers departs from the model's own tokenizer (see the module docstring)
_SMOLLM_DIGIT_AFTER_SPACES = re.compile(r"\s\s\d")
_GEMMA_LONG_SPACE_RUN = re.compile(" {32}")


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm2_gguf).metadata)


@pytest.fixture(scope="module")
def gemma_metadata(gemma3_gguf: Path) -> dict:
    return GGUFFile(gemma3_gguf).metadata


@pytest.fixture(scope="module")
def gemma3(gemma_metadata: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma_metadata)


@pytest.fixture(scope="module")
def gemma3_reference(gemma_metadata: dict):
    return _sentencepiece_reference(gemma_metadata)


@pytest.fixture(scope="module")
def smollm2_hf_digits(smollm2_hf):
    """transformers' SmolLM2 tokenizer with SmolLM2's own pre-tokenizer (its tokenizer.json's):
    every digit split off, then GPT-2's byte-level expression."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(smollm2_hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_gguf: Path):
    # AutoTokenizer picks GemmaTokenizer for a gemma3 file (checked below), but first parses the
    # whole file with gguf.GGUFReader for a model config the tokenizer does not use: a minute
    from transformers import GemmaTokenizer

    return GemmaTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)


def test_autotokenizer_picks_gemma_tokenizer_for_gemma3():
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    assert TOKENIZER_MAPPING_NAMES["gemma3"] == "GemmaTokenizer"


# ---------------------------------------------------------------- SmolLM2: byte-level BPE


@pytest.mark.parametrize("name", IDS)
def test_smollm2_ids_match_transformers(name, smollm2, smollm2_hf, smollm2_hf_digits):
    text = TEXTS[name]
    if _SMOLLM_DIGIT_AFTER_SPACES.search(text):
        assert smollm2.encode(text) == smollm2_hf_digits.encode(text).ids
    else:
        assert smollm2.encode(text) == smollm2_hf.encode(text)


def test_smollm2_splits_digits_as_its_own_tokenizer_does(smollm2, smollm2_hf, smollm2_hf_digits):
    text = TEXTS["digits after spaces"]
    ours = smollm2.encode(text)
    assert ours == smollm2_hf_digits.encode(text).ids
    # the exception above is real: transformers' GGUF tokenizer reads these spaces otherwise
    assert ours != smollm2_hf.encode(text), "transformers now splits digits for 'smollm'"
    space_run = smollm2.token_to_id("ĠĠ")
    assert space_run in ours  # "x  1": the two spaces are one token, as in SmolLM2's own


@pytest.mark.parametrize("name", IDS)
def test_smollm2_round_trip(name, smollm2):
    text = TEXTS[name]
    assert smollm2.decode(smollm2.encode(text)) == text


def test_smollm2_special_tokens(smollm2, smollm2_gguf):
    meta = GGUFFile(smollm2_gguf).metadata
    assert (smollm2.bos_id, smollm2.eos_id) == (
        meta["tokenizer.ggml.bos_token_id"],
        meta["tokenizer.ggml.eos_token_id"],
    )
    assert smollm2.pad_id == meta["tokenizer.ggml.padding_token_id"]
    assert smollm2.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert not smollm2.add_bos and smollm2.encode("hi")[0] != smollm2.bos_id
    # ChatML: the turn ends at <|im_end|> (SmolLM2's EOS), a document at <|endoftext|>
    ends = {smollm2.token_to_id("<|im_end|>"), smollm2.token_to_id("<|endoftext|>")}
    assert smollm2.eos_ids == ends and smollm2.eos_id in ends
    ids = smollm2.encode(TEXTS["chatml"])
    assert smollm2.decode(ids, skip_special=True) == "user\nhi there\nassistant\n"


# ---------------------------------------------------------------- Gemma 3: SentencePiece BPE


@pytest.mark.parametrize("name", IDS)
def test_gemma3_ids_match_transformers(name, gemma3, gemma3_hf):
    text = TEXTS[name]
    if _GEMMA_LONG_SPACE_RUN.search(text):
        assert gemma3.encode(text) != gemma3_hf.encode(text), "transformers now agrees"
    else:
        assert gemma3.encode(text) == gemma3_hf.encode(text)


@pytest.mark.parametrize("name", IDS)
def test_gemma3_ids_match_sentencepiece_bpe(name, gemma3, gemma3_reference):
    assert gemma3.encode(TEXTS[name], add_special=False) == gemma3_reference(TEXTS[name])


def test_gemma3_long_space_run_takes_the_longest_stored_run(gemma3):
    ids = gemma3.encode(" " * 40 + "x", add_special=False)
    assert [gemma3.id_to_token(i) for i in ids] == [" " * 31, " " * 9, "x"]


@pytest.mark.parametrize("name", IDS)
def test_gemma3_round_trip(name, gemma3):
    text = TEXTS[name]
    assert gemma3.decode(gemma3.encode(text, add_special=False)) == text


def test_gemma3_writes_spaces_as_sentencepiece_does(gemma3):
    # "▁" is SentencePiece's space: one written in the text comes back a space (in llama.cpp too)
    assert gemma3.decode(gemma3.encode("a▁b", add_special=False)) == "a b"


def test_gemma3_special_tokens(gemma3, gemma3_hf, gemma_metadata):
    assert gemma3.add_bos and gemma3.encode("hi")[0] == gemma3.bos_id
    assert gemma3.encode("hi", add_special=False)[0] != gemma3.bos_id
    assert (gemma3.bos_token, gemma3.eos_token) == (gemma3_hf.bos_token, gemma3_hf.eos_token)
    assert gemma3.vocab_size == len(gemma_metadata["tokenizer.ggml.tokens"]) == len(gemma3_hf)
    # the base model has no template, but its vocabulary holds Gemma's end of turn
    assert gemma3.eos_ids == {gemma3.eos_id, gemma3.token_to_id("<end_of_turn>")}
    ids = gemma3.encode(TEXTS["gemma turns"])
    for skip in (False, True):
        assert gemma3.decode(ids, skip_special=skip) == gemma3_hf.decode(
            ids, skip_special_tokens=skip
        )


def _sentencepiece_reference(metadata: dict):
    """Encode as llama.cpp does a SentencePiece vocabulary (``llm_tokenizer_spm``,
    https://github.com/ggml-org/llama.cpp/blob/master/src/llama-vocab.cpp), written plainly:
    control and user-defined tokens are cut out of the text, longest first; spaces become ``▁``;
    then the adjacent pair of pieces whose union is the highest-scoring normal token is merged
    (the leftmost on a tie) until none is; a piece that is no token is spelled in bytes."""
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    types = metadata["tokenizer.ggml.token_type"]
    normal = {t: (scores[i], i) for i, t in enumerate(tokens) if types[i] == 1}
    whole = [(t, i) for i, t in enumerate(tokens) if types[i] in (3, 4)]
    whole.sort(key=lambda pair: -len(pair[0]))
    byte = {int(t[3:5], 16): i for i, t in enumerate(tokens) if types[i] == 6}

    def merge(text: str) -> list[int]:
        pieces = list(text.replace(" ", "▁"))
        while True:
            best = None  # (score, position)
            for k in range(len(pieces) - 1):
                found = normal.get(pieces[k] + pieces[k + 1])
                if found and (best is None or found[0] > best[0]):
                    best = (found[0], k)
            if best is None:
                break
            k = best[1]
            pieces[k : k + 2] = [pieces[k] + pieces[k + 1]]
        ids = []
        for piece in pieces:
            ids.extend([normal[piece][1]] if piece in normal else [byte[b] for b in piece.encode()])
        return ids

    def encode(text: str) -> list[int]:
        parts: list[str | int] = [text]
        for token, id_ in whole:
            cut: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or token not in part:
                    cut.append(part)
                    continue
                for k, piece in enumerate(part.split(token)):
                    cut.extend(([id_] if k else []) + ([piece] if piece else []))
            parts = cut
        return [i for p in parts for i in ([p] if isinstance(p, int) else merge(p))]

    return encode


# ---------------------------------------------------------------- streaming


def test_a_stream_never_shows_half_a_character(smollm2, gemma3):
    from dikkat.text.stream import TextStream

    text = TEXTS["emoji"] + TEXTS["turkish"] + TEXTS["cjk"] + TEXTS["rare characters"]
    for tok in (smollm2, gemma3):
        ids = tok.encode(text, add_special=False)
        # not trivially true: a character spans several ids, so a prefix decodes to U+FFFD
        assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))
        stream = TextStream(tok)
        pieces = [stream.push(i) for i in ids] + [stream.finish()]
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == text


# ---------------------------------------------------------------- refusals


def _byte_level_metadata(pre: str, extra: tuple[str, ...] = ()) -> dict:
    """A GGUF header of a tiny byte-level vocabulary: the 256 byte symbols, no merges, ``extra``
    normal tokens, and a control token as BOS/EOS."""
    from tokenizers import pre_tokenizers

    tokens = ["<|end|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), *extra]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }


def test_an_unsupported_vocabulary_is_refused_by_name():
    with pytest.raises(ValueError, match=re.escape("tokenizer.ggml.model 'bert'")):
        Tokenizer.from_gguf_metadata(
            {**_byte_level_metadata("gpt2"), "tokenizer.ggml.model": "bert"}
        )
    with pytest.raises(ValueError, match=re.escape("tokenizer.ggml.pre 'made-up'")):
        Tokenizer.from_gguf_metadata(_byte_level_metadata("made-up"))
    no_merges = _byte_level_metadata("gpt2")
    del no_merges["tokenizer.ggml.merges"]
    with pytest.raises(ValueError, match=re.escape("needs tokenizer.ggml.merges")):
        Tokenizer.from_gguf_metadata(no_merges)
    with pytest.raises(ValueError, match=re.escape("tokenizer.ggml.tokens")):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def test_bad_ids_and_text_are_refused(smollm2):
    with pytest.raises(ValueError, match=r"ids\[1\] = 49152 is outside the vocabulary"):
        smollm2.decode([5, 49152])
    with pytest.raises(ValueError, match=r"ids\[0\] = -1"):
        smollm2.decode([-1])
    with pytest.raises(TypeError, match=r"ids\[0\] must be an int"):
        smollm2.decode(["a"])
    with pytest.raises(TypeError, match=r"ids\[0\] must be an int"):
        smollm2.decode([True])
    with pytest.raises(TypeError, match="text must be a str"):
        smollm2.encode(b"bytes")
    with pytest.raises(ValueError, match="id = 49152"):
        smollm2.id_to_token(49152)


def test_torch_and_numpy_ids_decode(smollm2):
    import numpy as np
    import torch

    ids = smollm2.encode(TEXTS["turkish"])
    text = smollm2.decode(ids)
    assert smollm2.decode(list(torch.tensor(ids))) == text
    assert smollm2.decode(np.array(ids)) == text


# ---------------------------------------------------------------- other vocabularies


@pytest.mark.parametrize("pre", ["default", "gpt2", "llama-bpe", "qwen2", "tekken"])
def test_pre_tokenizers_cut_text_as_transformers_does(pre):
    convert = pytest.importorskip("transformers.integrations.gguf").convert_gguf_tokenizer
    meta = _byte_level_metadata(pre)
    ours = Tokenizer.from_gguf_metadata(meta).backend.pre_tokenizer
    theirs, _ = convert(
        "llama",
        {
            "tokenizer_type": "gpt2",
            "pre_tokenizer_type": pre,
            "tokens": meta["tokenizer.ggml.tokens"],
            "token_type": meta["tokenizer.ggml.token_type"],
            "merges": [],
        },
    )
    for text in TEXTS.values():
        assert ours.pre_tokenize_str(text) == theirs.pre_tokenizer.pre_tokenize_str(text)


def test_llama3_takes_a_word_in_the_vocabulary_whole():
    # llama.cpp (and Llama 3's tokenizer.json, "ignore_merges") take a word that is a token
    # as it is, even when no merge builds it; and start a Llama 3 text with BOS
    llama3 = Tokenizer.from_gguf_metadata(_byte_level_metadata("llama-bpe", extra=("word",)))
    qwen2 = Tokenizer.from_gguf_metadata(_byte_level_metadata("qwen2", extra=("word",)))
    assert llama3.encode("word", add_special=False) == [llama3.token_to_id("word")]
    assert len(qwen2.encode("word")) == 4
    assert llama3.add_bos and not qwen2.add_bos


def _sentencepiece_metadata(prefix: bool) -> dict:
    """A GGUF header of a tiny SentencePiece vocabulary (Llama 2 / Mistral's layout): <unk>,
    <s>, </s>, the 256 byte tokens, then pieces scored best first."""
    pieces = ["▁", "h", "i", "e", "l", "o", "w", "r", "d", "▁h", "▁hi", "hi", "he", "ll"]
    pieces += ["llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁▁"]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"]
        + [f"<0x{b:02X}>" for b in range(256)]
        + pieces,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": prefix,
    }


SENTENCEPIECE_TEXTS = ["hi", "hello world", "  hello  world ", "<s>hello</s> world", "héllo\n", ""]


def test_a_space_prefix_is_added_as_transformers_does():
    convert = pytest.importorskip("transformers.integrations.gguf").convert_gguf_tokenizer
    meta = _sentencepiece_metadata(prefix=True)
    ours = Tokenizer.from_gguf_metadata(meta)
    theirs, _ = convert(
        "llama",
        {
            "tokenizer_type": "llama",
            "tokens": meta["tokenizer.ggml.tokens"],
            "scores": meta["tokenizer.ggml.scores"],
            "token_type": meta["tokenizer.ggml.token_type"],
        },
    )
    assert ours.add_bos and ours.encode("hi")[0] == ours.bos_id
    for text in SENTENCEPIECE_TEXTS:
        ids = ours.encode(text, add_special=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids
        # the prefix comes off again; a text's own first space is where SentencePiece put it
        assert ours.decode(ids) == (text[1:] if text.startswith(" ") else text)
    assert ours.encode("hi", add_special=False) == [ours.token_to_id("▁hi")]


def test_no_space_prefix_when_the_file_says_so():
    # llama.cpp follows tokenizer.ggml.add_space_prefix, and so does dikkat (Gemma 3 sets it
    # False); transformers' reader drops it for a 'llama' architecture and always prefixes
    tok = Tokenizer.from_gguf_metadata(_sentencepiece_metadata(prefix=False))
    assert tok.encode("hi", add_special=False) == [tok.token_to_id("hi")]
    for text in SENTENCEPIECE_TEXTS:
        assert tok.decode(tok.encode(text, add_special=False)) == text


# ---------------------------------------------------------------- Hugging Face folders


def _hf_folder(folder: Path, tokenizer: Tokenizer, *, bos: bool, **config) -> Path:
    """``tokenizer`` saved as an HF folder: its tokenizer.json (whose post-processor adds BOS
    when ``bos``) and a tokenizer_config.json of ``config``."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_str(tokenizer.backend.to_str())
    single = [tokenizer.bos_token, "$A"] if bos else ["$A"]
    special = [(tokenizer.bos_token, tokenizer.bos_id)] if bos else []
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("bos", [False, True])
def test_an_hf_folder_matches_transformers(tmp_path, smollm2, bos):
    from transformers import AutoTokenizer

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "add_bos_token": not bos,  # transformers 5 goes by the tokenizer.json, and so does dikkat
        "chat_template": template,
    }
    _hf_folder(tmp_path, smollm2, bos=bos, **config)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok, found = Tokenizer.from_hf_folder(tmp_path)
    assert found == template
    assert tok.add_bos == bos and tok.eos_ids == smollm2.eos_ids | {7}
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS.values():
        expected = [tok.bos_id] * bos + smollm2.encode(text)
        assert tok.encode(text) == expected == hf.encode(text)
        assert tok.encode(text, add_special=False) == smollm2.encode(text)


def test_an_hf_folder_template_file_comes_first(tmp_path, smollm2):
    _hf_folder(tmp_path, smollm2, bos=False)
    assert Tokenizer.from_hf_folder(tmp_path)[1] is None
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert Tokenizer.from_hf_folder(tmp_path)[1] == "d"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_folder(tmp_path)[1] == "{{ messages[0]['content'] }}"


def test_bad_hf_folders_are_refused(tmp_path, smollm2):
    with pytest.raises(ValueError, match=re.escape("holds no tokenizer.json")):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape("not a readable tokenizer.json")):
        Tokenizer.from_hf_folder(tmp_path)
    _hf_folder(tmp_path, smollm2, bos=False, eos_token="<missing>")
    with pytest.raises(ValueError, match="eos_token '<missing>'"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ValueError, match=r"chat template .* is a int"):
        Tokenizer.from_hf_folder(tmp_path)
