"""The model work of an engine step: a prompt's prefill and the batched decode forward over the
paged pool, and each row's next token.

Notation: ``B`` sequences, ``T`` new tokens, ``S`` slots attended, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dikkat.core.masks import causal, padding
from dikkat.generation.generate import sample
from dikkat.models.gpt import GPT
from dikkat.serving.paged import PagedKVPool, left_padded_slots, slot_table, slots_of
from dikkat.serving.requests import SamplingParams


@torch.no_grad()
def prefill(
    model: GPT, pool: PagedKVPool, tokens: Sequence[int], blocks: Sequence[int], start: int
) -> Tensor:
    """Prompt ``tokens`` from position ``start`` on through the model (the keys and values of
    0 … start − 1 are in the blocks already: a shared prefix), written into the sequence's
    ``blocks``; the logits (1, V) of the token after the prompt."""
    device = model.tok_emb.weight.device
    n = len(tokens)
    read = slots_of(slot_table([blocks]), torch.arange(n).unsqueeze(0), pool.block_size)  # (1, n)
    ids = torch.tensor([list(tokens[start:])], device=device)  # (1, T)
    logits = model(ids, offset=start, cache=pool.layers(read[:, start:], read), last_only=True)
    return logits[:, -1]


@torch.no_grad()
def decode(
    model: GPT,
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
    :mod:`dikkat.generation`; the padding mask hides each row's pads, ``positions`` give each
    row its own place for the position embeddings.
    """
    device = model.tok_emb.weight.device
    lengths = torch.tensor(positions) + 1
    read, valid, where = left_padded_slots(slot_table(tables), lengths, pool.block_size)  # (B, S)
    S = read.shape[1]
    ids = torch.tensor([[t] for t in last], device=device)  # (B, 1)
    logits = model(
        ids,
        causal() & padding(valid=valid.to(device)),
        offset=S - 1,
        positions=where[:, -1:].to(device),  # (B, 1)
        cache=pool.layers(read[:, -1:], read),
        last_only=True,
    )
    return logits[:, -1]


def next_tokens(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Row b's next token from logits (B, V): greedy, or sampled with its own parameters and
    generator exactly as :func:`dikkat.generation.generate` samples one prompt's."""
    picked = logits.argmax(dim=-1).tolist()  # every greedy row in one call
    for b, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.temperature > 0:
            row = logits[b : b + 1]  # (1, V): the draw generate() makes for one prompt
            token = sample(
                row, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, generator=generator
            )
            picked[b] = int(token)
    return picked
