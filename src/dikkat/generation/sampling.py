"""How a sequence is decoded: :class:`SamplingParams`, one frozen object that every entry point
takes (``generate``, ``iter_generate``, ``lookup_generate``, the models' ``generate``, the
pretrained wrapper, the serving engine), checked when it is made, and its keyword form
(:class:`Sampling`, :func:`as_params`). :mod:`dikkat.generation.sampler` applies it to logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from dikkat.generation.constraint import CONSTRAINTS, Constraint, constraint_of
from dikkat.validate import check_bool, check_float, check_int, is_int

MAX_TOP_LOGPROBS = 20  # alternatives per position, OpenAI's limit for chat


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one prompt (or each prompt of a batch).

    Fields are checked when the object is made; a ``logit_bias`` given as a dict becomes a
    sorted tuple of pairs (so the object stays hashable and frozen). Which entry point honours
    what: token-level decoding (``generate``, ``iter_generate``, the engine) works in token ids,
    so it refuses ``stop`` strings, which whoever decodes text matches (``Pretrained``, the
    server); ``generate`` returns token ids, so log-probabilities come from the engine
    (docs/generation.md has the table).
    """

    max_new_tokens: int = 16  # new tokens at most (0: none; with prompt_logprobs, scoring only)
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # sample among the k most likely tokens
    top_p: float | None = None  # nucleus: the smallest set of tokens reaching mass top_p
    seed: int | None = None  # seeds the draws; None: torch's global generator
    stop_ids: tuple[int, ...] = ()  # token ids that end a row (EOS); the stop token is emitted
    stop: tuple[str, ...] = ()  # strings that end the text (matched where text is decoded)
    n: int = 1  # choices per prompt
    logprobs: bool = False  # each new token's log-probability
    top_logprobs: int = 0  # the most likely alternatives reported per position
    prompt_logprobs: bool = False  # every prompt token's log-probability (the first has none)
    frequency_penalty: float = 0.0  # per earlier occurrence of a token in the generated text
    presence_penalty: float = 0.0  # once a token occurs in the generated text
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to its logit
    min_new_tokens: int = 0  # new tokens made before a stop token may be picked
    repetition_penalty: float = 1.0  # a seen token's logit: > 0 divided by it, < 0 multiplied
    # what the text must match, one at most (dikkat.generation.constraint; docs/generation.md):
    json_schema: str | None = None  # a JSON Schema (a dict, its JSON text, a pydantic model)
    regex: str | None = None  # a regular expression the whole text matches
    choice: tuple[str, ...] = ()  # the text is one of these strings
    grammar: str | None = None  # a context-free grammar: Lark, or llama.cpp's GBNF

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, at_least=0)
        check_float("temperature", self.temperature, low=0.0)
        check_int("top_k", self.top_k, optional=True)
        check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True, optional=True)
        check_int("seed", self.seed, at_least=0, at_most=2**64 - 1, optional=True)
        _set(self, "stop_ids", _token_ids("stop_ids", self.stop_ids))
        _set(self, "stop", _strings("stop", self.stop))
        check_int("n", self.n)
        check_bool("logprobs", self.logprobs)
        check_int("top_logprobs", self.top_logprobs, at_least=0, at_most=MAX_TOP_LOGPROBS)
        check_bool("prompt_logprobs", self.prompt_logprobs)
        if self.top_logprobs and not (self.logprobs or self.prompt_logprobs):
            raise ValueError(
                f"top_logprobs={self.top_logprobs} needs logprobs=True (or prompt_logprobs=True)"
            )
        check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _set(self, "logit_bias", _biases(self.logit_bias))
        check_int("min_new_tokens", self.min_new_tokens, at_least=0)
        check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}"
            )
        given = {f: getattr(self, f) for f in CONSTRAINTS}
        _set(self, "_constraint", constraint_of(given))  # checks them, one at most
        if self._constraint is not None:  # each in its normal form (a schema as compact JSON)
            _set(self, self._constraint.kind, self._constraint.value)
            if self.min_new_tokens and self.stop_ids:
                raise ValueError(
                    f"min_new_tokens={self.min_new_tokens} and {self._constraint.kind} cannot "
                    "both hold: a text the constraint completes sooner could not end"
                )

    @property
    def constraint(self) -> Constraint | None:
        """What the text must match (``json_schema``, ``regex``, ``choice`` or ``grammar``), or
        None."""
        return self._constraint  # type: ignore[attr-defined,no-any-return]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, biases or a ban of the stop tokens change the logits before the
        pick."""
        banned = self.min_new_tokens > 0 and bool(self.stop_ids)
        repeats = self.repetition_penalty != 1.0
        penalties = self.frequency_penalty or self.presence_penalty or repeats
        return bool(penalties or self.logit_bias or banned)

    def choices(self) -> list[SamplingParams]:
        """``n`` single-choice copies: choice i is seeded ``seed + i`` (None stays None), so
        choice 0 is the request with ``n = 1``."""

        def seed(i: int) -> int | None:
            return None if self.seed is None else (self.seed + i) % 2**64

        return [dataclasses.replace(self, n=1, seed=seed(i)) for i in range(self.n)]

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids named here exist in a vocabulary of ``vocab_size``."""
        for t in self.stop_ids:
            if t >= vocab_size:
                raise ValueError(
                    f"a stop token (eos_id={t}, in stop_ids={self.stop_ids}) is outside the "
                    f"vocabulary of {vocab_size}"
                )
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise ValueError(
                    f"logit_bias names token {t}, outside the vocabulary of {vocab_size}"
                )

    def refuse(self, where: str, *fields: str) -> None:
        """A ``ValueError`` for the first of ``fields`` set away from its default, saying
        ``where`` cannot honour it."""
        for f in fields:
            value = getattr(self, f)
            if value != _DEFAULTS[f]:
                raise ValueError(f"{where} cannot honour {f}={value!r}: {_WHY[f]}")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
_WHY = {
    "stop": "it works in token ids; stop strings are matched where text is decoded "
    "(dikkat.pretrained, the server)",
    "logprobs": "it returns token ids; the serving engine returns log-probabilities "
    "(dikkat.serving.Engine)",
    "top_logprobs": "it returns token ids; the serving engine returns log-probabilities",
    "prompt_logprobs": "it returns token ids; the serving engine returns log-probabilities",
    "n": "decode each of params.choices() on its own",
    "temperature": "it decodes greedily",
    "top_k": "it decodes greedily",
    "top_p": "it decodes greedily",
    "seed": "it decodes greedily",
    "frequency_penalty": "it checks guessed drafts against the model's greedy tokens",
    "presence_penalty": "it checks guessed drafts against the model's greedy tokens",
    "logit_bias": "it checks guessed drafts against the model's greedy tokens",
    "min_new_tokens": "it checks guessed drafts against the model's greedy tokens",
    "repetition_penalty": "it checks guessed drafts against the model's greedy tokens",
    **dict.fromkeys(CONSTRAINTS, "it checks guessed drafts against the model's greedy tokens"),
}


def _set(params: SamplingParams, name: str, value: object) -> None:
    object.__setattr__(params, name, value)  # a normalised field of a frozen dataclass


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a tuple of int token ids, got {type(ids).__name__}")
    for i, token in enumerate(ids):
        if not is_int(token) or token < 0:
            raise ValueError(f"{name}[{i}] must be a token id (an int ≥ 0), got {token!r}")
    return tuple(int(t) for t in ids)


def _strings(name: str, strings: object) -> tuple[str, ...]:
    if isinstance(strings, str):
        strings = (strings,)
    if not isinstance(strings, Sequence) or not all(isinstance(s, str) for s in strings):
        raise TypeError(f"{name} must be a tuple of strings, got {strings!r}")
    if any(s == "" for s in strings):
        raise ValueError(f"{name} holds an empty string, which would stop before any text")
    return tuple(strings)


def _biases(bias: object) -> tuple[tuple[int, float], ...]:
    items = list(bias.items()) if isinstance(bias, Mapping) else bias
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"logit_bias must be a dict {{token id: bias}}, got {type(bias).__name__}")
    pairs = {}
    for pair in items:
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        token, value = pair
        if not is_int(token) or token < 0:
            raise ValueError(f"logit_bias names {token!r}, not a token id (an int ≥ 0)")
        # a number (a TypeError otherwise) in OpenAI's range, refused in the words the server
        # passes on to its clients (a NaN or an infinity is outside the range too)
        try:
            check_float(f"logit_bias[{token}]", value, low=-100.0, high=100.0)
        except ValueError:
            why = f"logit_bias[{token}] = {value}: a bias must be in [-100, 100]"
            raise ValueError(why) from None
        pairs[int(token)] = float(value)
    return tuple(sorted(pairs.items()))


class Sampling(TypedDict, total=False):
    """The keyword form of :class:`SamplingParams` (``eos_id`` is ``stop_ids=(eos_id,)``)."""

    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    eos_id: int | None
    stop_ids: tuple[int, ...]
    stop: str | Sequence[str]
    n: int
    frequency_penalty: float
    presence_penalty: float
    logit_bias: Mapping[int, float]
    min_new_tokens: int
    repetition_penalty: float
    json_schema: str | Mapping[str, Any] | type | None
    regex: str | None
    choice: Sequence[str]
    grammar: str | None


def as_params(params: SamplingParams | int | None, keywords: Mapping[str, Any]) -> SamplingParams:
    """``params`` as it is; or, for the keyword form of the generation functions, the
    :class:`SamplingParams` of ``keywords`` (``params`` an int: ``max_new_tokens``)."""
    if isinstance(params, SamplingParams):
        if keywords:
            raise TypeError(
                f"give the sampling settings in params or as keywords, not both (got "
                f"params and {', '.join(sorted(keywords))})"
            )
        return params
    fields = dict(keywords)
    if params is not None:
        if not is_int(params):
            raise TypeError(
                f"params must be a SamplingParams or max_new_tokens (an int), got "
                f"{type(params).__name__}"
            )
        if "max_new_tokens" in fields:
            raise TypeError(f"max_new_tokens is given twice: {params} and as a keyword")
        fields["max_new_tokens"] = params
    unknown = sorted(set(fields) - set(Sampling.__annotations__))
    if unknown:
        raise TypeError(
            f"unknown sampling keyword {unknown[0]!r}; the keywords are "
            f"{', '.join(Sampling.__annotations__)}"
        )
    eos_id = check_int("eos_id", fields.pop("eos_id", None), at_least=0, optional=True)
    if eos_id is not None:
        if "stop_ids" in fields:
            raise TypeError("give eos_id or stop_ids, not both")
        fields["stop_ids"] = (eos_id,)
    return SamplingParams(**fields)
