"""The model work of an engine step: a prompt's prefill and the batched decode forward over the
paged pool, for any decoder of :class:`dikkat.generation.DecoderLM`, and the events of each
sequence's next token.

Notation: ``B`` sequences, ``T`` new tokens, ``S`` slots attended, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dikkat.core.masks import dense
from dikkat.generation.constraint import mask_logits, take
from dikkat.generation.protocol import DecoderLM
from dikkat.generation.sampler import TokenLogprob, largest_finite, token_logprobs
from dikkat.serving.paged import PagedKVPool, left_padded_slots, slot_table, slots_of
from dikkat.serving.requests import EngineSequence, TokenEvent, describe


@torch.no_grad()
def prefill(
    model: DecoderLM,
    pool: PagedKVPool,
    tokens: Sequence[int],
    blocks: Sequence[int],
    start: int,
    *,
    every: bool = False,
) -> Tensor:
    """Prompt ``tokens`` from position ``start`` on through the model (the keys and values of
    0 … start − 1 are in the blocks already: a shared prefix), written into the sequence's
    ``blocks``; the logits (1, V) of the token after the prompt, or with ``every`` the logits
    (T, V) after each of the T tokens fed."""
    device = model.cache_layout().device
    n = len(tokens)
    read = slots_of(slot_table([blocks]), torch.arange(n).unsqueeze(0), pool.block_size)  # (1, n)
    ids = torch.tensor([list(tokens[start:])], device=device)  # (1, T)
    cache = pool.layers(read[:, start:], read)
    logits = model(ids, offset=start, cache=cache, last_only=not every)
    return logits[0] if every else logits[:, -1]


@torch.no_grad()
def decode(
    model: DecoderLM,
    pool: PagedKVPool,
    last: Sequence[int],
    positions: Sequence[int],
    tables: Sequence[Sequence[int]],
) -> Tensor:
    """One forward for the whole batch: row b feeds token ``last[b]`` at position
    ``positions[b]`` (its keys and values go to that slot of its block table ``tables[b]``,
    which holds the earlier ones) and attends its own slots only; the logits (B, V).

    The rows' slots are gathered right-aligned, so that every new token sits in the view's last
    column S − 1 (the ``offset`` of the forward) as in a left-padded batch of
    :mod:`dikkat.generation`; ``positions`` give each row its own place for the position
    embeddings. A query in the last column sees every column causally, so the mask is the
    padding alone: ``valid`` as a dense (B, 1, 1, S) mask, made once for all layers (what
    ``causal() & padding(valid=valid)`` gives, without evaluating that predicate in every
    layer); rows of equal length (one sequence) pass none, and the model's causal default hides
    nothing in the last column, so SDPA runs unmasked, as when ``generate`` decodes.
    """
    device = model.cache_layout().device
    lengths = torch.tensor(positions) + 1
    read, valid, where = left_padded_slots(slot_table(tables), lengths, pool.block_size)  # (B, S)
    B, S = read.shape
    ids = torch.tensor([[t] for t in last], device=device)  # (B, 1)
    mask = None if len(set(positions)) == 1 else dense(valid.view(B, 1, 1, S).to(device), S - 1)
    logits = model(
        ids,
        mask,
        offset=S - 1,
        positions=where[:, -1:].to(device),  # (B, 1)
        cache=pool.layers(read[:, -1:], read),
        last_only=True,
    )
    return logits[:, -1]


@torch.no_grad()
def pool_decode(
    step: Callable[[Tensor, Tensor, Tensor], Tensor],
    pool: PagedKVPool,
    last: Sequence[int],
    positions: Sequence[int],
    tables: Sequence[Sequence[int]],
) -> Tensor:
    """What :func:`decode` does, through a model's pool step (``model.pool_step`` over the
    pool's layers, :class:`~dikkat.models.static_step.PoolStep`): row b's tokens 0 …
    ``positions[b]`` at the slots of its block table, the columns past its position (slots of
    block 0, or of its own later blocks) hidden by the step itself. The logits (B, V)."""
    device = pool.k.device
    B, S = len(last), max(positions) + 1
    columns = torch.arange(S).expand(B, S)
    slots = slots_of(slot_table(tables), columns, pool.block_size).to(device)  # (B, S)
    ids = torch.tensor(last, device=device)
    return step(ids, torch.tensor(positions, device=device), slots)


def decode_rows(
    model: DecoderLM,
    step: Callable[[Tensor, Tensor, Tensor], Tensor] | None,
    pool: PagedKVPool,
    rows: Sequence[EngineSequence],
) -> Tensor:
    """One decode forward for the sequences ``rows``, each feeding its last token at its next
    position: through ``step`` (a model's pool step) if given, else :func:`decode`. The logits
    (B, V)."""
    batch = ([s.tokens[-1] for s in rows], [s.cached for s in rows], [s.blocks for s in rows])
    if step is None:
        return decode(model, pool, *batch)
    return pool_decode(step, pool, *batch)


def first_events(model: DecoderLM, pool: PagedKVPool, seq: EngineSequence) -> list[TokenEvent]:
    """Run a new request's prompt (after its shared prefix); its first event (its last, with an
    error, when the prompt's logits are not finite). A preempted request admitted again has
    its tokens but the last run instead, and no event: the next decode step goes on."""
    if seq.generated:  # a preempted request, admitted again: its keys and values, no event
        prefill(model, pool, seq.tokens[: seq.fed], seq.blocks, seq.cached)
        seq.cached = seq.fed
        return []
    every = seq.params.prompt_logprobs  # then nothing was shared: seq.cached == 0
    logits = prefill(model, pool, seq.tokens, seq.blocks, seq.cached, every=every)
    seq.cached = seq.prompt_len
    prompt = None
    if every:  # row i of the logits predicts prompt token i + 1
        finite = torch.isfinite(logits).all(dim=-1)  # (T,)
        if not bool(finite.all()):
            return [seq.fail(not_finite(int((~finite).nonzero()[0])))]
        following = torch.tensor(seq.tokens[1:], device=logits.device)
        prompt = (None, *token_logprobs(logits[:-1], following, seq.params.top_logprobs))
        logits = logits[-1:]
    if seq.params.max_new_tokens == 0:
        seq.finish = "length"
        return [TokenEvent(seq.id, None, "length", prompt_logprobs=prompt)]
    return emit([seq], logits, prompt)


def not_finite(position: int) -> str:
    return (
        f"the model's output is not finite (NaN or inf) at position {position}: no token can be "
        f"drawn from it (non-finite weights, or a kernel's fault)"
    )


def emit(
    seqs: list[EngineSequence],
    logits: Tensor,
    prompt: tuple[TokenLogprob | None, ...] | None = None,
) -> list[TokenEvent]:
    """Each sequence's next token from its row of ``logits`` (B, V), recorded as an event
    (the first carries ``prompt``, the prompt's log-probabilities, when given). A row that is
    not finite, or whose draw raises, ends its sequence alone with an error event: a NaN row
    would otherwise become a token (argmax picks a NaN's index) and a sampler would raise for
    the whole batch. Rows held to a constraint pick from their masked logits (all such rows
    masked at once) and report the model's own log-probabilities."""
    held = [(s.matcher, b) for b, s in enumerate(seqs) if s.matcher is not None]
    masked = mask_logits(logits, held) if held else logits
    greedy, finite = largest_finite(logits, masked)
    events = []
    for b, seq in enumerate(seqs):
        if not finite[b]:
            events.append(seq.fail(not_finite(len(seq.tokens) - 1)))
            continue
        try:
            events.append(_next(seq, logits[b : b + 1], masked[b : b + 1], greedy[b], prompt))
        except Exception as e:  # this request's sampling parameters on these logits
            events.append(seq.fail(f"drawing the next token failed: {describe(e)}"))
    return events


def _next(
    seq: EngineSequence,
    row: Tensor,
    masked: Tensor,
    greedy: int,
    prompt: tuple[TokenLogprob | None, ...] | None,
) -> TokenEvent:
    """The sequence's next token from its ``row`` (1, V) of logits (``masked`` by its
    constraint, if any): ``greedy`` (the masked row's
    :func:`~dikkat.generation.sampler.largest`, the sampler's own greedy pick) for a plain
    greedy request, else its own sampler's draw, the one :func:`dikkat.generation.generate`
    makes for one prompt."""
    p = seq.params
    token = greedy if p.greedy and not p.adjusts_logits else int(seq.sampler.pick(masked))
    if seq.matcher is not None:
        take(seq.matcher, token)
    logprob = None
    if p.logprobs:
        chosen = torch.tensor([token], device=row.device)
        logprob = token_logprobs(row, chosen, p.top_logprobs)[0]
    seq.tokens.append(token)
    if token in p.stop_ids:
        seq.finish = "stop"
    elif seq.generated == p.max_new_tokens:
        seq.finish = "length"
    return TokenEvent(seq.id, token, seq.finish, logprob, prompt)
