"""Prompt-lookup decoding: greedy generation that guesses its next tokens by copying them from the
prompt and the text so far, and checks a whole guess in one forward pass.

Notation: ``T`` prompt length, ``k`` guessed (drafted) tokens, ``V`` vocabulary.

This is speculative decoding (Leviathan et al., 2023, "Fast Inference from Transformers via
Speculative Decoding") with a string match for the draft model, after Saxena's "prompt lookup
decoding" (github.com/apoorvumang/prompt-lookup-decoding, 2023; Hugging Face transformers'
``prompt_lookup_num_tokens``): where the last n tokens occurred before, the tokens that followed
them are guessed to follow again. Code, summaries of a document, edits of a text repeat their
input, so the guesses are often right.

The model runs once over the last token and the k guesses, at their cache slots; its argmax at
each slot is the token greedy decoding would produce there. The longest prefix of guesses equal to
those argmaxes is kept, and the argmax after it (at the first wrong guess, or after the last) comes
free: each model call gives 1 to k + 1 tokens, the tokens of greedy
:func:`~dikkat.generation.generate`. The slots written for the rejected guesses need no clean-up:
the next call writes from the first of them on, and :meth:`~dikkat.layers.KVCache.update` returns
(so attention reads) only the slots up to the end of its own write.

Equal tokens up to rounding: a call over k + 1 tokens multiplies (k + 1)-row matrices where a
one-token step multiplies one row, and the sums may round differently in their last bits; only a
near tie between the two best logits can then break the other way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from typing_extensions import Unpack

from dikkat.core.masks import causal
from dikkat.generation.constraint import CONSTRAINTS
from dikkat.generation.generate import TOKEN_LEVEL, check_room, prefill
from dikkat.generation.prompts import Prompts, left_pad
from dikkat.generation.protocol import DecoderLM
from dikkat.generation.sampler import check_finite
from dikkat.generation.sampling import Sampling, SamplingParams, as_params
from dikkat.layers.kv_cache import KVCache
from dikkat.validate import check_int
from dikkat.weights.formats import WeightFormat
from dikkat.weights.inference import inference_model


@dataclass
class LookupStats:
    """What lookup decoding did: pass one to count; each generation adds to it."""

    tokens: int = 0  # new tokens produced
    calls: int = 0  # model forward passes, the prefill included (plain greedy: one per token)
    drafted: int = 0  # guessed tokens the model checked
    accepted: int = 0  # guesses equal to the model's own next token

    @property
    def acceptance(self) -> float:
        """Accepted guesses / checked guesses (0 when nothing was guessed)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_call(self) -> float:
        """New tokens per model forward pass (1 for plain greedy decoding)."""
        return self.tokens / self.calls if self.calls else 0.0


class NgramIndex:
    """A growing token sequence and, for each n-gram (n = 1 … ``ngram``) in it, where it last
    occurred with a token after it: the guess for what follows the sequence's last n tokens.

    >>> index = NgramIndex(2, [5, 6, 7, 1, 5, 6])
    >>> index.draft(4)  # [5, 6] was followed by 7, 1, 5, 6; and the copy continues itself
    [7, 1, 5, 6]
    """

    def __init__(self, ngram: int, tokens: Sequence[int] = ()) -> None:
        check_int("ngram", ngram)
        self.ngram = ngram
        self.tokens: list[int] = []
        # _starts[n - 1][n-gram] = start of its latest occurrence that a token follows
        self._starts: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram)]
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        t, end = self.tokens, len(self.tokens)
        # the n-grams ending at the old last token are now followed by ``token``
        for n in range(1, min(self.ngram, end) + 1):
            self._starts[n - 1][tuple(t[end - n :])] = end - n
        t.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` guessed next tokens: what followed the latest earlier occurrence of the
        last n tokens, for the largest n ≤ ``ngram`` that occurred; none when no n matched.

        The copy reads on into its own guesses where it reaches the end of the sequence, so a
        repeating period yields k tokens even when it is shorter than k.
        """
        t = self.tokens
        for n in range(min(self.ngram, len(t)), 0, -1):
            start = self._starts[n - 1].get(tuple(t[-n:]))
            if start is not None:
                src, out = start + n, []  # src < len(t): the n-gram had a token after it
                for j in range(k):
                    i = src + j
                    out.append(t[i] if i < len(t) else out[i - len(t)])
                return out
        return []


# lookup decoding checks guesses against the model's greedy tokens, one choice per prompt
GREEDY_ONLY = (
    "temperature", "top_k", "top_p", "seed", "n",
    "frequency_penalty", "presence_penalty", "logit_bias", "min_new_tokens", "repetition_penalty",
    *TOKEN_LEVEL, *CONSTRAINTS,
)  # fmt: skip


def iter_lookup_generate(
    model: DecoderLM,
    prompts: Prompts,
    params: SamplingParams | int | None = None,
    *,
    k: int = 8,
    ngram: int = 3,
    weights: WeightFormat | None = None,
    stats: LookupStats | None = None,
    **sampling: Unpack[Sampling],
) -> Iterator[Tensor]:
    """Greedy decoding of one prompt by prompt lookup: yields the new tokens, (1,) each, as
    :func:`~dikkat.generation.iter_generate` does at temperature 0 (and equal to its tokens).

    ``prompts`` is one prompt in the forms ``iter_generate`` takes (``[[1, 2, 3]]`` or a (1, T)
    tensor): the guesses come from a row's own text, so rows are decoded one at a time. Each
    model call checks up to ``k`` tokens guessed by matching the last ``ngram`` tokens (then
    fewer, down to one) against the prompt and the tokens so far. ``params`` (or an int
    ``max_new_tokens`` and keywords, as ``iter_generate`` takes them) must ask for greedy
    decoding; generation stops after a stop token (``stop_ids``, ``eos_id=``) or
    ``max_new_tokens``. ``weights`` is the format the linear layers multiply in
    ("fp32", "bf16", "int8", "w8a8", or None, as :func:`~dikkat.generation.iter_generate`
    takes it): decoding runs on an inference copy made here
    (:func:`dikkat.weights.inference_model`).
    ``stats``, when given, counts the tokens, model calls, and guessed and accepted tokens. The
    arguments are checked here, when it is called.
    """
    c = model.config
    params = as_params(params, sampling)
    params.refuse("lookup decoding", *GREEDY_ONLY)
    params.check_vocab(c.vocab_size)
    check_int("k", k)
    check_int("ngram", ngram)
    if stats is not None and not isinstance(stats, LookupStats):
        raise TypeError(f"stats must be a LookupStats or None, got {type(stats).__name__}")
    ids, _ = left_pad(prompts, 0, vocab_size=c.vocab_size)
    if ids.shape[0] != 1:
        raise ValueError(
            f"lookup decoding takes one prompt (batch 1), got {ids.shape[0]}: each row guesses "
            "from its own text, so call it once per prompt"
        )
    check_room(ids.shape[1], params.max_new_tokens, c.max_len)
    model = inference_model(model, weights)  # type: ignore[arg-type,assignment]
    device = model.cache_layout().device
    stats = LookupStats() if stats is None else stats
    stops = frozenset(params.stop_ids)
    return _lookup(model, ids.to(device), params.max_new_tokens, k, ngram, stops, stats)


def _lookup(
    model: DecoderLM,
    ids: Tensor,
    max_new_tokens: int,
    k: int,
    ngram: int,
    stops: frozenset[int],
    stats: LookupStats,
) -> Iterator[Tensor]:
    if max_new_tokens == 0:
        return
    T = ids.shape[1]
    index = NgramIndex(ngram, ids[0].tolist())
    cache = model.new_cache(1, T + max_new_tokens)
    first = prefill(model, ids, cache)
    check_finite(first, 0)
    predicted = [int(first.argmax(dim=-1))]
    stats.calls += 1
    draft: list[int] = []
    produced = 0
    while True:
        # predicted[j] follows draft[: j]: it is greedy's token while every guess before held
        for j, token in enumerate(predicted):
            guessed = j < len(draft) and token == draft[j]
            produced += 1
            stats.tokens += 1
            stats.accepted += guessed
            index.append(token)
            yield torch.tensor([token], device=ids.device)
            if produced == max_new_tokens or token in stops:
                return
            if not guessed:  # the last token predicted from a right context
                break
        # no guess past the last new token: its slot would lie outside the cache
        draft = index.draft(min(k, max_new_tokens - produced - 1))
        predicted = _check_draft(model, [token, *draft], cache, T + produced - 1, produced)
        stats.calls += 1
        stats.drafted += len(draft)


@torch.no_grad()
def _check_draft(
    model: DecoderLM, tokens: list[int], cache: list[KVCache], slot: int, step: int
) -> list[int]:
    """Feed ``tokens`` at cache slots ``slot`` … (the last real token, then the guesses); the
    greedy next token after each, k + 1 of them (the first is new token ``step``)."""
    device = cache[0].k.device
    logits = model(torch.tensor([tokens], device=device), causal(), offset=slot, cache=cache)
    check_finite(logits[0], step)
    return logits[0].argmax(dim=-1).tolist()  # (1, k + 1, V) → k + 1 tokens


def lookup_generate(
    model: DecoderLM,
    prompts: Prompts,
    params: SamplingParams | int | None = None,
    *,
    k: int = 8,
    ngram: int = 3,
    weights: WeightFormat | None = None,
    stats: LookupStats | None = None,
    **sampling: Unpack[Sampling],
) -> list[list[int]]:
    """The prompt followed by its new tokens, cut after its stop token, as one list in a list (what
    greedy :func:`~dikkat.generation.generate` returns for it), in fewer model calls. The
    arguments are those of :func:`iter_lookup_generate`.

    >>> from dikkat.generation import generate
    >>> from dikkat.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=16, max_len=32, d_model=16, n_layers=1, n_heads=2))
    >>> stats = LookupStats()
    >>> out = lookup_generate(model.eval(), [[1, 2, 3, 1, 2]], 10, k=4, stats=stats)
    >>> out == generate(model, [[1, 2, 3, 1, 2]], 10), stats.tokens
    (True, 10)
    """
    params = as_params(params, sampling)
    tokens = iter_lookup_generate(
        model, prompts, params, k=k, ngram=ngram, weights=weights, stats=stats
    )
    new = [int(t) for t in tokens]
    prompt = prompts[0]
    return [(prompt.tolist() if isinstance(prompt, Tensor) else list(prompt)) + new]
