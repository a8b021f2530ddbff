"""The model work of an engine step, run so that a failure ends the request it belongs to and no
other (docs/engine.md, "When a request fails").

Notation: ``B`` sequences decoded in the step, ``P`` slots per block.

- **Prefills** are one forward per request: each is tried on its own, and one that raises fails
  its request.
- **The decode** is one forward for the batch. When it raises, each half of the batch runs again,
  down to the single rows that still raise (bisection: one bad row among B costs about
  2·log2(B) more forwards). Running a row again is safe: a decode writes the keys and values of
  the one token it feeds into that token's own slot (``PagedLayerCache.update`` and the pool
  step both write slot ``table[p // P] · P + p % P`` of position p, never a prefix block, which
  holds prompt positions only), so a second run writes the same slot again, and a sequence's
  ``cached`` count moves on only once its forward has returned.
- **The prefix cache**: a request's prompt blocks are indexed when it is admitted, before its
  prefill writes them, so that a request admitted after it in the same step can share them
  (``Engine._admit``). A block whose prefill failed holds nothing of its prefix: a later
  request of the step that shares it computes its prompt again from that block on (writing what
  the failed one would have), and a block left unwritten at the end of the prefills is taken out
  of the index (:meth:`~dikkat.serving.paged.BlockAllocator.forget`).

A request whose forward raises fails even when it ran alone, or when every request of the step
failed: a broken model or device then fails each request with its own error, and the requests
still waiting are not touched (they run, and fail or not, in later steps). Only an error
outside the model work (the allocator's) is the engine's: it drops every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import Tensor

from dikkat.generation.protocol import DecoderLM
from dikkat.serving.forward import emit, first_events
from dikkat.serving.paged import PagedKVPool
from dikkat.serving.requests import EngineSequence, TokenEvent, describe

Forward = Callable[[list[EngineSequence]], Tensor]  # the decode of some rows: logits (rows, V)


@dataclass
class StepWork:
    """What the model work of one step came to: its events (tokens, and the failed requests'
    last ones)."""

    events: list[TokenEvent] = field(default_factory=list)

    def fail(self, seq: EngineSequence, error: Exception) -> None:
        self.events.append(seq.fail(f"the model failed on this request: {describe(error)}"))


def prefill_each(
    model: DecoderLM, pool: PagedKVPool, admitted: list[EngineSequence], work: StepWork
) -> tuple[set[int], int]:
    """Each admitted request's prompt, in the order admitted, on its own. Returns the blocks
    its prefill was to write and none did (to be taken out of the prefix index), and the prompt
    tokens found in the cache that were computed again (their block's prefill failed)."""
    P = pool.block_size
    unwritten = {b for seq in admitted for b in seq.blocks[seq.cached // P :]}  # fresh ones
    recomputed = 0
    for seq in admitted:
        for i, block in enumerate(seq.blocks[: seq.cached // P]):
            if block in unwritten:  # shared from a request admitted before it, which failed
                recomputed += seq.cached - i * P
                seq.cached = i * P
                break
        start = seq.cached
        try:
            events = first_events(model, pool, seq)
        except Exception as e:
            work.fail(seq, e)
            continue
        work.events += events
        if seq.finish != "error":  # not finite: its keys and values may be neither
            unwritten.difference_update(seq.blocks[start // P :])
    return unwritten, recomputed


def decode_each(forward: Forward, rows: list[EngineSequence], work: StepWork) -> None:
    """One decode forward for ``rows`` (bisected when it raises, see the module's docstring);
    each row that ran moves on by one cached token and gets its event."""
    for group, logits in _bisect(forward, rows, work):
        for seq in group:
            seq.cached += 1
        work.events += emit(group, logits)


def _bisect(
    forward: Forward, rows: list[EngineSequence], work: StepWork
) -> Iterator[tuple[list[EngineSequence], Tensor]]:
    try:
        logits = forward(rows)
    except Exception as e:
        if len(rows) == 1:
            work.fail(rows[0], e)
            return
        half = len(rows) // 2
        yield from _bisect(forward, rows[:half], work)
        yield from _bisect(forward, rows[half:], work)
        return
    yield rows, logits
