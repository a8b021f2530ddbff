"""Each family's tiny random Hugging Face folder, converted by llama.cpp's own
``convert_hf_to_gguf.py``, loads to the model the folder loads to: the same family, the same
logits, the same tokens. (``test_gguf_from_hf.py`` writes the files the converter's way without
it, to vary what a file holds; this test runs the converter itself.)

The converter comes from the llama-cpp-python sdist on PyPI; the Makefile unpacks it into
``.venv/llama.cpp-converter`` and names it in ``DIKKAT_LLAMACPP_CONVERTER``, where this test then
fails if it is missing. Run alone without it, the test skips, naming the Makefile."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_hf import COMMON, save_tiny, save_tokenizer

import dikkat
from dikkat.generation import generate

pytest.importorskip("transformers")

# family → what its folder must leave out, as a GGUF file cannot carry it: Qwen 2's window
# (llama.cpp's qwen2 has none), a Gemma 3 layer pattern other than one full layer in six
FAMILIES: dict[str, dict[str, object]] = {
    "llama": {},
    "llama3": {},
    "qwen2": {"use_sliding_window": False, "layer_types": ["full_attention"] * 3},
    "qwen3": {},
    "qwen3moe": {},
    "smollm3": {},
    "olmo2": {},
    "phi3": {},
    "phi4": {},
    "gemma2": {},
    "gemma3": {"layer_types": ["sliding_attention"] * 3},
}
ARCHITECTURES = {"llama3": "llama", "phi4": "phi3"}
SENTENCEPIECE = {"gemma2", "gemma3"}  # the converter reads these vocabularies from tokenizer.model
TEXTS = ["the winter in Ankara", "  spaces\tand\nnewlines  ", "çalışkan öğrenci, naïve 🙂", "x=12"]


def converter() -> Path:
    named = os.environ.get("DIKKAT_LLAMACPP_CONVERTER")
    folder = Path(named) if named else Path(sys.prefix) / "llama.cpp-converter"
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    if named:
        raise AssertionError(f"DIKKAT_LLAMACPP_CONVERTER={named} holds no convert_hf_to_gguf.py")
    pytest.skip(f"llama.cpp's converter is not in {folder}: `make test` unpacks it there")


def sentencepiece_model(folder: Path) -> None:
    """A small SentencePiece BPE with byte fallback, trained here, as ``tokenizer.model``; text
    taken as it is (no prefix space, spaces kept), as Gemma's is."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    text = (f"abc cab bca {i % 10}" for i in range(200))
    spm.SentencePieceTrainer.train(
        sentence_iterator=text, model_writer=model, model_type="bpe", byte_fallback=True,
        vocab_size=COMMON["vocab_size"] - 2, hard_vocab_limit=False,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, add_dummy_prefix=False,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.model").write_bytes(model.getvalue())


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family → (its folder, the file llama.cpp's converter wrote from it, in fp32)."""
    tool = converter()
    root = tmp_path_factory.mktemp("llamacpp")
    folders = {}
    for family, overrides in FAMILIES.items():
        folder = folders[family] = root / family
        save_tiny(family, folder, **overrides)
        save_tokenizer(folder, COMMON["vocab_size"], merges=True)
        if family in SENTENCEPIECE:
            sentencepiece_model(folder)
        if family in ("phi3", "phi4"):  # Phi-4-mini's: a GPT-2 vocabulary, not SentencePiece
            config = folder / "tokenizer_config.json"
            data = json.loads(config.read_text()) | {"tokenizer_class": "GPT2Tokenizer"}
            config.write_text(json.dumps(data))
    driver = Path(__file__).with_name("llamacpp_convert.py")
    done = subprocess.run(
        [sys.executable, str(driver), str(tool), "f32", *map(str, folders.values())],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {family: (folder, folder / "llamacpp.gguf") for family, folder in folders.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_converter_s_file_is_the_folder(converted, family):
    folder, path = converted[family]
    from_file, from_folder = dikkat.pretrained.load(path), dikkat.pretrained.load(folder)
    arch = ARCHITECTURES.get(family, family)
    assert from_file.model.config.family == from_folder.model.config.family == arch
    ids = torch.randint(2, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = from_file.model(ids), from_folder.model(ids)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    prompt = [[5, 9, 70, 200, 33, 12]]  # greedy, through the cached decode step
    assert generate(from_file.model, prompt, 12) == generate(from_folder.model, prompt, 12)
    tokenizer = from_file.tokenizer
    for text in TEXTS:
        if family in SENTENCEPIECE:  # against the sentencepiece library on the folder's model
            reference = sentencepiece_ids(folder, text)
            want = [tokenizer.bos_id] * tokenizer.add_bos + reference
        else:  # the folder's tokenizer.json is the byte-level BPE the file was made from
            want = from_folder.tokenizer.encode(text)
        assert tokenizer.encode(text) == want, text


def sentencepiece_ids(folder: Path, text: str) -> list[int]:
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).encode(
        text
    )
