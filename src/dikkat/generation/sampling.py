"""How a sequence is decoded: :class:`SamplingParams`, one frozen object that every entry point
takes (``generate``, ``iter_generate``, ``lookup_generate``, the models' ``generate``, the
pretrained wrapper, the serving engine), and the :class:`Sampler` that applies it to logits.

Notation: ``B`` rows, ``V`` vocabulary.

A token is picked in four stages, the order of OpenAI's and vLLM's samplers:

1. the model's logits, in fp32; their ``log_softmax`` is what log-probabilities report (the
   model's own distribution, before anything below: vLLM's default "raw" log-probabilities);
2. penalties over the tokens this row has generated so far (OpenAI's definition,
   https://platform.openai.com/docs/advanced-usage/frequency-and-presence-penalties):
   ``logit[j] −= count[j] · frequency_penalty + (count[j] > 0) · presence_penalty``, then
   ``logit_bias`` added, and the stop tokens' logits set to −inf while the row has made fewer
   than ``min_new_tokens`` (vLLM's ``min_tokens``);
3. greedy (``temperature = 0``): the largest adjusted logit;
4. otherwise the adjusted logits divided by the temperature, cut to the ``top_k`` largest and to
   the nucleus of mass ``top_p`` (Holtzman et al., "The Curious Case of Neural Text
   Degeneration", ICLR 2020), and one draw from their softmax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from torch import Tensor

from dikkat.kernels import argmax_op
from dikkat.validate import check_bool, check_float, check_int, is_int

MAX_TOP_LOGPROBS = 20  # alternatives per position, OpenAI's limit for chat


class NonFiniteLogitsError(ValueError):
    """A model's logits hold NaN or +inf (or a row is all −inf): no token can be picked from
    them, and picking one anyway (argmax takes a NaN as the largest: token 0, or EOS) would end
    in an empty or meaningless answer. The model's weights or inputs hold non-finite values — a
    damaged file, or weights that overflowed. A ``ValueError``: the command line reports it in
    one line, as it does a damaged file."""


def check_finite(logits: Tensor, step: int) -> None:
    """Raise :class:`NonFiniteLogitsError` unless every row of ``logits`` (B, V), those of the
    ``step``-th new token (from 0), has a finite largest value. One reduction per row: a NaN
    anywhere makes the row's ``amax`` NaN."""
    bad = ~torch.isfinite(logits.amax(dim=-1))
    if not bool(bad.any()):
        return
    rows = bad.nonzero().flatten().tolist()
    kind = "NaN" if bool(logits[rows].isnan().any()) else "infinite"
    shown = ", ".join(map(str, rows[:8])) + (", …" if len(rows) > 8 else "")
    raise NonFiniteLogitsError(
        f"the model's output (its logits) is {kind} at step {step} (new token {step + 1}), "
        f"row{'s' if len(rows) > 1 else ''} {shown}: the model's weights or inputs hold "
        "non-finite values (NaN or Inf), as a damaged model file does"
    )


def largest(logits: Tensor) -> Tensor:
    """``logits.argmax(dim=-1)`` of (B, V) logits: the first of equal values, a NaN as the
    largest. fp32 logits on the CPU go through dikkat's native kernel where it is loaded (a
    model with packed weights loads it): PyTorch's CPU argmax reads a row of 50 000 logits a
    value at a time, a share of a small model's decode step."""
    op = argmax_op()
    fits = logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_cpu
    if op is not None and fits and logits.shape[1] > 0:
        return op(logits)
    return logits.argmax(dim=-1)


def largest_finite(logits: Tensor) -> tuple[list[int], list[bool]]:
    """:func:`largest` of each row of (B, V) logits, and whether the row is finite (no NaN or
    infinity anywhere in it), read back in one host sync: what a batch of rows, each of its
    own request, needs before it picks or fails each row alone."""
    picks, finite = torch.stack((largest(logits), torch.isfinite(logits).all(dim=-1).long()))
    return picks.tolist(), [bool(f) for f in finite.tolist()]


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
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, biases or a ban of the stop tokens change the logits before the
        pick."""
        banned = self.min_new_tokens > 0 and bool(self.stop_ids)
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias or banned)

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


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the most likely tokens at its place."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


def token_logprobs(logits: Tensor, tokens: Tensor, top: int) -> list[TokenLogprob]:
    """For each row of logits (R, V): the log-probability of ``tokens[r]`` and the ``top``
    most likely (id, log-probability), from ``log_softmax`` in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens.view(-1, 1).to(logp.device)).squeeze(-1).tolist()
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        tops = [tuple(zip(i, v, strict=True)) for i, v in pairs]
    else:
        tops = [()] * len(chosen)
    return [
        TokenLogprob(int(t), float(lp), tp)
        for t, lp, tp in zip(tokens.tolist(), chosen, tops, strict=True)
    ]


class Sampler:
    """Picks the next token of B rows that share :class:`SamplingParams`, keeping what the
    picks need between steps: the generator (seeded on the logits' device at the first pick)
    and, with penalties, each row's counts of the tokens it generated."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        self.counts: Tensor | None = None  # (B, V) generated-token counts, with penalties
        self._bias: Tensor | None = None
        self.made = 0  # picks so far: tokens each row has generated

    def pick(self, logits: Tensor) -> Tensor:
        """Next tokens (B,) from logits (B, V); they count as generated for the penalties."""
        p = self.params
        if self.generator is None and p.seed is not None and not p.greedy:
            self.generator = torch.Generator(device=logits.device).manual_seed(p.seed)
        if p.adjusts_logits:
            logits = self._adjust(logits.float())
        if p.greedy:
            token = largest(logits)
        else:
            token = draw(logits, p.temperature, p.top_k, p.top_p, self.generator)
        if p.frequency_penalty or p.presence_penalty:
            if self.counts is None:
                self.counts = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
            self.counts.scatter_add_(
                -1, token.view(-1, 1), torch.ones(token.numel(), 1, device=logits.device)
            )
        self.made += 1
        return token

    def _adjust(self, logits: Tensor) -> Tensor:
        p = self.params
        if self.counts is not None:
            logits = logits - self.counts * p.frequency_penalty
            logits = logits - (self.counts > 0).float() * p.presence_penalty
        if p.logit_bias:
            if self._bias is None:
                ids, values = zip(*p.logit_bias, strict=True)
                self._bias = torch.zeros(logits.shape[-1], device=logits.device)
                self._bias[list(ids)] = torch.tensor(values, device=logits.device)
            logits = logits + self._bias
        if self.made < p.min_new_tokens and p.stop_ids:
            logits = logits.index_fill(
                -1, torch.tensor(p.stop_ids, device=logits.device), -torch.inf
            )
        return logits


def draw(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """One draw per row from the softmax of logits / temperature, cut to top-k and top-p."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
