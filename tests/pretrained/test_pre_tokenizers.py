"""Each byte-level pre-tokenizer the families' GGUF files name (``tokenizer.ggml.pre``), against
the tokenizer the model itself ships, as transformers runs it: a BPE vocabulary trained here on
the Python installation's own source with that model's pre-tokenizer (its ``tokenizer.json``,
written out below as the model card's file holds it), written as a GGUF header and read back by
dikkat, encodes a battery of code, accents (composed and not), emoji, digits, whitespace runs
and special tokens to the same ids."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest

from dikkat.pretrained import Tokenizer

transformers = pytest.importorskip("transformers")
from tokenizers import Regex, decoders, normalizers, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as Backend  # noqa: E402
from tokenizers.models import BPE  # noqa: E402
from tokenizers.trainers import BpeTrainer  # noqa: E402

# the split expressions of the models' own tokenizer.json files
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


def split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])  # fmt: skip


# tokenizer.ggml.pre → (its models, their pre-tokenizer, normalizer, ignore_merges)
REFERENCES = {
    "llama-bpe": ("Llama 3.x, SmolLM3", split_then_bytes(LLAMA3), None, True),
    "dbrx": ("DBRX, OLMo 2", split_then_bytes(LLAMA3), None, False),
    "qwen2": ("Qwen 2, 2.5, 3, 3-MoE", split_then_bytes(QWEN2), normalizers.NFC(), False),
    "smollm": (
        "SmolLM, SmolLM2",
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        ),
        None,
        False,
    ),
    "gpt-2": ("GPT-2", pre_tokenizers.ByteLevel(add_prefix_space=False), None, False),
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

BATTERY = [
    "def f(x):\n    return x ** 2  # squared\n\n\n\tif x != 0: pass\r\n",
    "Ünïcödé: café, naïve, façade — Straße; ça va? déjà vu.",
    "cafe\u0301 and nai\u0308ve, decomposed",  # combining marks: NFC composes them
    "emoji 😀👍🏽 👨‍👩‍👧 🇹🇷 and ✓ ✗ ☃",
    "digits 1 12 123 1234 12345 3.14159 1,000,000 0x1F 2026-12-07",
    "spaces:  two,   three,\t\ttabs, trailing   ",
    "\n\n\nnewlines\n \n  \nmixed",
    "Türkçe: dikkat, ığüşöç İĞÜŞÖÇ; 日本語のテキスト; Ελληνικά; русский текст",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "I'm, you're, they've, she'll, we'd, IT'S, DON'T",
    "x=[1,2,3];y={'a':1}//2**3>>1<<2!=~0 && a||b",
    "",
]


def corpus() -> list[str]:
    """Text to train on: the standard library's own source, and the battery's scripts."""
    texts = [inspect.getsource(module) for module in (textwrap, json.decoder, json.encoder)]
    return texts + BATTERY * 3


def reference(pre: str) -> Backend:
    _, splitter, normalizer, whole = REFERENCES[pre]
    backend = Backend(BPE(ignore_merges=whole))
    backend.pre_tokenizer = splitter
    backend.decoder = decoders.ByteLevel()
    if normalizer is not None:
        backend.normalizer = normalizer
    trainer = BpeTrainer(vocab_size=1200, special_tokens=SPECIAL, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(corpus(), trainer)
    return backend


def as_gguf(backend: Backend, pre: str) -> dict:
    """The GGUF header llama.cpp's converter writes for the vocabulary."""
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIAL else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
    }


@pytest.mark.parametrize("pre", REFERENCES)
def test_the_gguf_pre_tokenizer_encodes_as_the_model_s_own(pre):
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=reference(pre))
    ours = Tokenizer.from_gguf_metadata(as_gguf(theirs.backend_tokenizer, pre))
    assert len(theirs) == ours.vocab_size > 600  # merges were learned
    for text in BATTERY:
        want = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special=False) == want, (pre, text)
        assert ours.decode(want) == theirs.decode(want), (pre, text)
