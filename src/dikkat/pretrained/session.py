"""A loaded pretrained model with its tokenizer: text in, text out, and chat in its own template.

Generation runs :func:`dikkat.iter_generate` (the KV cache, the sampling, the weight formats of
every dikkat decoder); a row ends at any of the tokenizer's end-of-generation ids (EOS, and the
end-of-turn token of a chat format), which is not part of the text returned, or at a ``stop``
string of its :class:`~dikkat.generation.SamplingParams` (the text is cut before it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from dikkat.generation.constraint import Grammars
from dikkat.generation.generate import iter_generate
from dikkat.generation.sampling import Sampling, SamplingParams, as_params
from dikkat.interop.gguf_gpt import architecture_of
from dikkat.models.aot_step import compile_by_default
from dikkat.models.decoder import Decoder
from dikkat.models.gpt import GPT, GPTConfig
from dikkat.pretrained.chat_template import check_unicode, render_chat
from dikkat.pretrained.chat_tokens import ChatTokens
from dikkat.pretrained.tokenizer import Tokenizer
from dikkat.text.stream import TextStream
from dikkat.validate import check_bool
from dikkat.weights.formats import WeightFormat
from dikkat.weights.inference import inference_model

__all__ = ["Pretrained"]


class Pretrained:
    """``model`` (a :class:`~dikkat.models.Decoder`, or a :class:`~dikkat.models.GPT` read from
    a GPT-2 GGUF file), ``tokenizer``, and the model's chat template (None for a base model
    without one).

    >>> lm = dikkat.pretrained.load("smollm2")  # doctest: +SKIP
    >>> lm.chat([{"role": "user", "content": "What is the capital of France?"}])  # doctest: +SKIP
    'The capital of France is Paris.'
    """

    def __init__(
        self,
        model: Decoder | GPT,
        tokenizer: Tokenizer,
        chat_template: str | None,
        name: str,
        path: Path,
        sampling_defaults: Sampling | None = None,
    ) -> None:
        self.model, self.tokenizer, self.chat_template = model, tokenizer, chat_template
        self.name, self.path = name, path
        # what the model's files suggest (dikkat.pretrained.sampling_defaults): the keywords a
        # call's own keywords are laid over (a SamplingParams given is used as it is)
        self.sampling_defaults: Sampling = dict(sampling_defaults or {})  # type: ignore[assignment]
        # True: one prompt at a time decodes through the model's compiled step, built on a
        # machine's first run of the model and kept on disk (dikkat.models.aot_step); False: the
        # eager steps. Default: True unless the environment sets DIKKAT_COMPILE=0
        self.compile_steps = compile_by_default()
        self._text = _TextOf(tokenizer)
        self._chat_tokens = ChatTokens(tokenizer)
        # the inference copy generation runs, kept between calls (see _runnable)
        self._copy: tuple[tuple[object, ...], nn.Module] | None = None
        self._grammars: Grammars | None = None

    def __repr__(self) -> str:
        c = self.model.config
        if isinstance(c, GPTConfig):  # a GPT-2 or StarCoder2 GGUF file's
            family, kv_heads = architecture_of(c), c.block().kv_heads
        else:
            family, kv_heads = c.family, c.kv_heads
        return (
            f"Pretrained({self.name!r}: {family}, {c.n_layers} layers, width {c.d_model}, "
            f"{c.n_heads} heads over {kv_heads}, {self.model.n_params / 1e6:.0f}M parameters)"
        )

    def generate(
        self,
        text: str | Sequence[str],
        params: SamplingParams | int | None = None,
        *,
        weights: WeightFormat | None = None,
        **sampling: Unpack[Sampling],
    ) -> str | list[str]:
        """The continuation of ``text`` (a str → a str; a list of str → a list, one per text,
        decoded together in one batch), greedy by default.

        ``params`` is a :class:`~dikkat.generation.SamplingParams`, or an int
        ``max_new_tokens`` (default 128; 256 for chat) with the other fields as keywords
        (``temperature=0.7, seed=0``), laid over :attr:`sampling_defaults` (the settings the
        model's files suggest, if any); its ``stop`` strings end a text (cut before them)."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError("text must be a str or a non-empty list of str")
        for k, t in enumerate(texts):
            check_unicode("text" if isinstance(text, str) else f"text[{k}]", t)
        params = self._params(params, sampling)
        prompts = [self.tokenizer.encode(t) for t in texts]
        streams = [TextStream(self._text, params.stop) for _ in prompts]
        pieces: list[list[str]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for tokens in self._steps(prompts, params, weights):
            for i, token in enumerate(tokens.tolist()):
                if done[i]:
                    continue
                if token in self.tokenizer.eos_ids:
                    done[i] = True
                    continue
                pieces[i].append(streams[i].push(token))
                done[i] = streams[i].stopped
            if all(done):
                break
        out = ["".join(p) + stream.finish() for p, stream in zip(pieces, streams, strict=True)]
        return out[0] if isinstance(text, str) else out

    def stream(
        self,
        text: str,
        params: SamplingParams | int | None = None,
        *,
        weights: WeightFormat | None = None,
        **sampling: Unpack[Sampling],
    ) -> Iterator[str]:
        """The continuation of one ``text``, piece by piece as it is generated (whole characters
        only); the arguments are those of :meth:`generate`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        check_unicode("text", text)
        params = self._params(params, sampling)
        yield from self._stream_ids(self.tokenizer.encode(text), params, weights)

    def chat_prompt(
        self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, **template: Any
    ) -> str:
        """``messages`` rendered in the model's chat template, ready for the assistant's turn;
        ``tools`` (OpenAI's function definitions) reach a template that renders them, and
        ``template`` are further variables of it (``enable_thinking=False``)."""
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
            **template,
            **({} if tools is None else {"tools": list(tools)}),
        )

    def chat_ids(
        self,
        messages: Sequence[dict],
        *,
        special_in_content: bool = False,
        tools: Sequence[dict] | None = None,
        **template: Any,
    ) -> list[int]:
        """The token ids of :meth:`chat_prompt`: the template writes the special tokens (BOS
        included) itself, and they are encoded without adding any, as transformers'
        ``apply_chat_template(tokenize=True)`` does. A special token's string inside a message
        (``<|im_start|>`` in a user's text) is encoded as plain text, so that no message can
        forge a turn (:mod:`dikkat.pretrained.chat_tokens`); ``special_in_content=True``
        encodes it as the special token, as transformers does. ``tools`` and ``template``: as
        for :meth:`chat_prompt`."""
        render = functools.partial(self.chat_prompt, tools=tools, **template)
        if check_bool("special_in_content", special_in_content):
            return self.tokenizer.encode(render(messages), add_special=False)
        return self._chat_tokens.ids(messages, render)

    def chat(
        self,
        messages: Sequence[dict],
        params: SamplingParams | int | None = None,
        *,
        weights: WeightFormat | None = None,
        **sampling: Unpack[Sampling],
    ) -> str:
        """The assistant's answer to ``messages`` (``[{"role": "user", "content": ...}, …]``);
        the other arguments are those of :meth:`generate`."""
        params = self._params(params, sampling, default=256)
        return "".join(self.chat_stream(messages, params, weights=weights))

    def chat_stream(
        self,
        messages: Sequence[dict],
        params: SamplingParams | int | None = None,
        *,
        weights: WeightFormat | None = None,
        **sampling: Unpack[Sampling],
    ) -> Iterator[str]:
        """:meth:`chat`'s answer, piece by piece as it is generated."""
        params = self._params(params, sampling, default=256)
        yield from self._stream_ids(self.chat_ids(messages), params, weights)

    def _params(
        self, params: SamplingParams | int | None, sampling: Sampling, default: int = 128
    ) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            sampling = {**self.sampling_defaults, **sampling}  # type: ignore[typeddict-item]
        if params is None and "max_new_tokens" not in sampling:
            sampling = {**sampling, "max_new_tokens": default}
        params = as_params(params, sampling)
        params.refuse("Pretrained", "n")  # one text per prompt
        return params

    def _stream_ids(
        self, ids: list[int], params: SamplingParams, weights: WeightFormat | None
    ) -> Iterator[str]:
        stream = TextStream(self._text, params.stop)
        for tokens in self._steps([ids], params, weights):
            token = int(tokens[0])
            if token in self.tokenizer.eos_ids:
                break
            if piece := stream.push(token):
                yield piece
            if stream.stopped:
                break
        if rest := stream.finish():
            yield rest

    def _steps(
        self, prompts: list[list[int]], params: SamplingParams, weights: WeightFormat | None
    ) -> Iterator[torch.Tensor]:
        if any(not p for p in prompts):
            raise ValueError("a prompt encodes to no tokens: give some text")
        pad = self.tokenizer.pad_id or 0
        # the end-of-generation ids stop the rows; stop strings are matched on the text here
        params = dataclasses.replace(
            params, stop=(), stop_ids=(*params.stop_ids, *sorted(self.tokenizer.eos_ids))
        )
        compile = self.compile_steps and len(prompts) == 1
        grammars = self.grammars() if params.constraint is not None else None
        return iter_generate(
            self._runnable(weights), prompts, params, pad_id=pad, weights=weights,
            compile=compile, grammars=grammars,
        )  # fmt: skip

    def grammars(self) -> Grammars:
        """The constraints' compiler for this model's vocabulary (made at the first constrained
        request, kept; :mod:`dikkat.generation.constraint`)."""
        if self._grammars is None:
            vocab = self.model.config.vocab_size
            self._grammars = Grammars(self.tokenizer, vocab, self.tokenizer.eos_ids)
        return self._grammars

    def _runnable(self, weights: WeightFormat | None) -> nn.Module:
        """The inference copy of the model in format ``weights`` (``inference_model``), made once
        and kept while the model's parameters are the same tensors, unchanged (their version
        counters): its products' copies (oneDNN's reordered weights, a whole copy of an fp32
        model's matrices) are made at the first prompt and not again at every call. A model
        that holds its weights as a file does (packed, 16-bit) is its own copy."""
        params = list(self.model.parameters())
        key = (weights, id(self.model), *((id(p), p._version) for p in params))
        if self._copy is None or self._copy[0] != key:
            self._copy = None  # the old copy's memory goes before the new one is made
            self._copy = (key, inference_model(self.model, weights))
        return self._copy[1]


class _TextOf:
    """Generated ids → text: special tokens left out, and so are the ids past the tokenizer's
    vocabulary that a model's embedding may have (rows padded to a round size, e.g. Qwen2's),
    which have no text (transformers decodes them as nothing too)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        known = [i for i in ids if i < self.tokenizer.vocab_size]
        return self.tokenizer.decode(known, skip_special=True)
