"""A loaded pretrained model with its tokenizer: text in, text out, and chat in its own template.

Generation runs :func:`dikkat.iter_generate` (the KV cache, the sampling, the weight formats of
every dikkat decoder); a row ends at any of the tokenizer's end-of-generation ids (EOS, and the
end-of-turn token of a chat format), which is not part of the text returned.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from dikkat.generation.generate import iter_generate
from dikkat.layers.quantized import WeightFormat
from dikkat.models.decoder import Decoder
from dikkat.pretrained.chat_template import render_chat
from dikkat.pretrained.tokenizer import Tokenizer
from dikkat.text.stream import TextStream
from dikkat.validate import check_int

__all__ = ["Pretrained"]


class Pretrained:
    """``model`` (a :class:`~dikkat.models.Decoder`), ``tokenizer``, and the model's chat
    template (None for a base model without one).

    >>> lm = dikkat.pretrained.load("smollm2")  # doctest: +SKIP
    >>> lm.chat([{"role": "user", "content": "What is the capital of France?"}])  # doctest: +SKIP
    'The capital of France is Paris.'
    """

    def __init__(
        self,
        model: Decoder,
        tokenizer: Tokenizer,
        chat_template: str | None,
        name: str,
        path: Path,
    ) -> None:
        self.model, self.tokenizer, self.chat_template = model, tokenizer, chat_template
        self.name, self.path = name, path
        self._text = _TextOf(tokenizer)
        self._decode = self._text.decode

    def __repr__(self) -> str:
        c = self.model.config
        return (
            f"Pretrained({self.name!r}: {c.family}, {c.n_layers} layers, width {c.d_model}, "
            f"{c.n_heads} heads over {c.kv_heads}, {self.model.n_params / 1e6:.0f}M parameters)"
        )

    def generate(
        self,
        text: str | Sequence[str],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        weights: WeightFormat | None = None,
    ) -> str | list[str]:
        """The continuation of ``text`` (a str → a str; a list of str → a list, one per text,
        decoded together in one batch), greedy at temperature 0."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError("text must be a str or a non-empty list of str")
        prompts = [self.tokenizer.encode(t) for t in texts]
        settings = _settings(temperature, top_k, top_p, seed, weights)
        rows = self._generate_ids(prompts, max_new_tokens, settings)
        out = [self._decode(row) for row in rows]
        return out[0] if isinstance(text, str) else out

    def stream(
        self,
        text: str,
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        weights: WeightFormat | None = None,
    ) -> Iterator[str]:
        """The continuation of one ``text``, piece by piece as it is generated (whole characters
        only)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text)
        settings = _settings(temperature, top_k, top_p, seed, weights)
        yield from self._stream_ids(ids, max_new_tokens, settings)

    def chat_prompt(self, messages: Sequence[dict]) -> str:
        """``messages`` rendered in the model's chat template, ready for the assistant's turn."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no chat template (a base model): use generate() with plain text"
            )
        return render_chat(
            self.chat_template,
            list(messages),
            add_generation_prompt=True,
            bos_token=self.tokenizer.bos_token or "",
            eos_token=self.tokenizer.eos_token or "",
        )

    def chat(
        self,
        messages: Sequence[dict],
        max_new_tokens: int = 256,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        weights: WeightFormat | None = None,
    ) -> str:
        """The assistant's answer to ``messages`` (``[{"role": "user", "content": ...}, …]``)."""
        pieces = self.chat_stream(
            messages,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            weights=weights,
        )
        return "".join(pieces)

    def chat_stream(
        self,
        messages: Sequence[dict],
        max_new_tokens: int = 256,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        weights: WeightFormat | None = None,
    ) -> Iterator[str]:
        """:meth:`chat`'s answer, piece by piece as it is generated."""
        # the template writes the special tokens (BOS included) itself, as transformers'
        # apply_chat_template(tokenize=True) encodes without adding them
        ids = self.tokenizer.encode(self.chat_prompt(messages), add_special=False)
        settings = _settings(temperature, top_k, top_p, seed, weights)
        yield from self._stream_ids(ids, max_new_tokens, settings)

    def _stream_ids(
        self, ids: list[int], max_new_tokens: int, settings: dict[str, Any]
    ) -> Iterator[str]:
        stream = TextStream(self._text)
        for tokens in self._steps([ids], max_new_tokens, settings):
            token = int(tokens[0])
            if token in self.tokenizer.eos_ids:
                break
            if piece := stream.push(token):
                yield piece
        if rest := stream.finish():
            yield rest

    def _generate_ids(
        self, prompts: list[list[int]], max_new_tokens: int, settings: dict[str, Any]
    ) -> list[list[int]]:
        """The new tokens of each prompt, each row cut before its first end-of-generation id."""
        rows: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for tokens in self._steps(prompts, max_new_tokens, settings):
            for i, token in enumerate(tokens.tolist()):
                if done[i]:
                    continue
                if token in self.tokenizer.eos_ids:
                    done[i] = True
                else:
                    rows[i].append(token)
            if all(done):
                break
        return rows

    def _steps(
        self, prompts: list[list[int]], max_new_tokens: int, settings: dict[str, Any]
    ) -> Iterator[torch.Tensor]:
        check_int("max_new_tokens", max_new_tokens, at_least=0)
        if any(not p for p in prompts):
            raise ValueError("a prompt encodes to no tokens: give some text")
        pad = self.tokenizer.pad_id or 0
        return iter_generate(self.model, prompts, max_new_tokens, pad_id=pad, **settings)


def _settings(
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    weights: WeightFormat | None,
) -> dict[str, Any]:
    """The sampling keywords of :func:`dikkat.iter_generate`, checked by it."""
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, weights=weights)


class _TextOf:
    """Generated ids → text: special tokens left out, and so are the ids past the tokenizer's
    vocabulary that a model's embedding may have (rows padded to a round size, e.g. Qwen2's),
    which have no text (transformers decodes them as nothing too)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        known = [i for i in ids if i < self.tokenizer.vocab_size]
        return self.tokenizer.decode(known, skip_special=True)
