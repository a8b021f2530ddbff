"""How a token is picked from a model's logits: the :class:`Sampler` that applies
:class:`~dikkat.generation.sampling.SamplingParams`, greedy picks, draws, log-probabilities.

Notation: ``B`` rows, ``V`` vocabulary.

A token is picked in four stages, the order of OpenAI's and vLLM's samplers:

0. where the text must match a constraint (:mod:`dikkat.generation.constraint`), the logits of
   the tokens it forbids set to −inf, before anything else reads them;
1. the model's logits, in fp32; their ``log_softmax`` is what log-probabilities report (the
   model's own distribution, before anything below: vLLM's default "raw" log-probabilities);
2. a repetition penalty over the tokens this row has seen, its prompt's and its own (a positive
   logit divided by it, a negative one multiplied: Keskar et al. 2019, as HF and vLLM apply
   it); penalties over the tokens this row has generated so far (OpenAI's definition,
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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.generation.constraint import Guide
from dikkat.generation.sampling import SamplingParams
from dikkat.kernels import argmax_op


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


def largest_finite(logits: Tensor, masked: Tensor | None = None) -> tuple[list[int], list[bool]]:
    """:func:`largest` of each row of (B, V) logits (of ``masked``, the same logits with the
    tokens constraints forbid at −inf, if given), and whether the row of ``logits`` is finite
    (no NaN or infinity anywhere in it), read back in one host sync: what a batch of rows,
    each of its own request, needs before it picks or fails each row alone."""
    picked = largest(logits if masked is None else masked)
    picks, finite = torch.stack((picked, torch.isfinite(logits).all(dim=-1).long()))
    return picks.tolist(), [bool(f) for f in finite.tolist()]


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
    and, with penalties, each row's counts of the tokens it generated and, with a repetition
    penalty, which tokens each row has seen — its prompt's (``prompt`` (B, T) ids, a tensor or
    lists, ``valid`` (B, T) False at padding) and those it generated, as HF's
    ``RepetitionPenaltyLogitsProcessor`` and vLLM count them (Keskar et al. 2019,
    https://arxiv.org/abs/1909.05858, section 4.1). ``guide`` holds the rows to their
    constraints (:class:`~dikkat.generation.constraint.Guide`; None: free rows)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: Tensor | Sequence[Sequence[int]] | None = None,
        valid: Tensor | None = None,
        guide: Guide | None = None,
    ) -> None:
        self.params, self.guide = params, guide
        self.generator: torch.Generator | None = None
        self.counts: Tensor | None = None  # (B, V) generated-token counts, with penalties
        self.seen: Tensor | None = None  # (B, V) tokens of the prompt or generated, with rp
        self._prompt, self._valid = prompt, valid
        self._bias: Tensor | None = None
        self.made = 0  # picks so far: tokens each row has generated

    def pick(self, logits: Tensor) -> Tensor:
        """Next tokens (B,) from logits (B, V); they count as generated for the penalties."""
        p = self.params
        if self.guide is not None:
            logits = self.guide.mask(logits)
        if self.generator is None and p.seed is not None and not p.greedy:
            self.generator = torch.Generator(device=logits.device).manual_seed(p.seed)
        if p.repetition_penalty != 1.0 and self.seen is None:
            self.seen = self._seen_in_prompt(logits)
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
        if self.seen is not None:
            self.seen.scatter_(-1, token.view(-1, 1), True)
        if self.guide is not None:
            self.guide.advance(token.tolist())
        self.made += 1
        return token

    def _seen_in_prompt(self, logits: Tensor) -> Tensor:
        """(B, V): True at the tokens of each row's prompt (its valid places)."""
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        prompt = self._prompt
        if prompt is not None and len(prompt) and len(prompt[0]):
            ids = torch.as_tensor(prompt, device=logits.device).view(logits.shape[0], -1)
            valid = torch.ones_like(ids, dtype=torch.bool) if self._valid is None else self._valid
            valid = valid.to(logits.device).view(ids.shape)
            rows = torch.arange(ids.shape[0], device=logits.device)[:, None].expand_as(ids)
            seen[rows[valid], ids[valid]] = True
        return seen

    def _adjust(self, logits: Tensor) -> Tensor:
        p = self.params
        if self.seen is not None:
            rp = p.repetition_penalty
            penalised = torch.where(logits > 0, logits / rp, logits * rp)
            logits = torch.where(self.seen, penalised, logits)
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
