"""One request's failure never ends another's (docs/engine.md, "When a request fails"): a request
whose prefill or decode raises, or whose logits are not finite, fails alone with its error; the
others in its batch get the tokens ``generate()`` gives them alone, the prefix cache keeps no
block its failed prefill left unwritten, and the runner tells only the failed request.

The failures are made by hooks on the model (copied with it into the engine's snapshot) that
raise, or write NaN, for one token id or one position: a bad input that passed every check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from dikkat.generation import generate
from dikkat.models import GPT, GPTConfig
from dikkat.models.static_step import PoolStep
from dikkat.serving import BlockAllocator, Engine, SamplingParams, TokenEvent
from dikkat.serving.metrics import RequestCounter, parse, render
from dikkat.serving.runner import EngineRunner, Failure
from helpers import scramble

V = 61
K = 9  # the position a decode failure strikes at


def make_gpt(seed: int = 0, vocab: int = V) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=vocab, max_len=48, d_model=32, n_layers=2, n_heads=4)
    return scramble(GPT(config), seed)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model: GPT, tokens: list[int], n: int) -> list[int]:
    return generate(model, [tokens], SamplingParams(max_new_tokens=n))[0][len(tokens) :]


def unused(model: GPT, requests: list[tuple[list[int], int]]) -> int:
    """A token id that no request's prompt or tokens alone hold (the hooks' trigger)."""
    seen = {t for p, n in requests for t in p + alone(model, p, n)}
    return min(set(range(V)) - seen)


def drain(engine: Engine) -> dict[int, list[TokenEvent]]:
    streams: dict[int, list[TokenEvent]] = {}
    for _ in range(100):
        if not engine.has_work():
            break
        for e in engine.step():
            streams.setdefault(e.request_id, []).append(e)
    assert not engine.has_work()
    return streams


def tokens_of(events: list[TokenEvent]) -> list[int | None]:
    return [e.token for e in events]


def engine_with(model: GPT, hook: Callable, *, forward: bool = False, **kwargs) -> Engine:
    """An engine whose snapshot of ``model`` runs ``hook`` (a forward pre-hook, or with
    ``forward`` a forward hook), given the call's kwargs."""
    register = model.register_forward_hook if forward else model.register_forward_pre_hook
    handle = register(hook, with_kwargs=True)
    try:
        return Engine(model, block_size=4, **kwargs)
    finally:
        handle.remove()


def raise_on(bad: int) -> Callable:
    def hook(module, args, kwargs):
        if bool((args[0] == bad).any()):
            raise RuntimeError(f"token {bad} poisons this model")

    return hook


def at_position(k: int, kwargs: dict) -> torch.Tensor | None:
    """The rows (B,) a decode feeds at position k; None for a prefill."""
    positions = kwargs.get("positions")
    return None if positions is None else positions.view(-1) == k


def assert_failed(events: list[TokenEvent], match: str) -> None:
    last = events[-1]
    assert (last.token, last.finish_reason) == (None, "error")
    assert last.error is not None and match in last.error, last.error
    assert all(e.finish_reason is None for e in events[:-1])


def assert_serves_on(engine: Engine, model: GPT) -> None:
    """Later requests are served as if nothing had failed, and no block is held."""
    later = engine.submit(prompt(5, 40), SamplingParams(max_new_tokens=4))
    assert tokens_of(drain(engine)[later]) == alone(model, prompt(5, 40), 4)
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.running == 0


def test_an_id_past_the_embeddings_rows_is_refused_at_submit():
    model = make_gpt(seed=1, vocab=50)  # the config then claims 60 ids; the embedding has 50
    model.config = dataclasses.replace(model.config, vocab_size=60)
    engine = Engine(model, block_size=4)
    assert engine.vocab_size == 50
    with pytest.raises(ValueError, match=r"prompt\[2\] is 55, outside the vocabulary of 50"):
        engine.submit([1, 2, 55], SamplingParams(max_new_tokens=3))
    good = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=3))
    assert tokens_of(drain(engine)[good]) == alone(model, [1, 2, 3], 3)
    assert engine.stats().aborted == 0


@pytest.mark.parametrize("bad_first", [True, False])
def test_a_prefill_that_raises_fails_its_request_alone(bad_first):
    model = make_gpt(seed=2)
    good = prompt(7, 20)
    bad = unused(model, [(good, 6), (prompt(5, 40), 4)])
    engine = engine_with(model, raise_on(bad), max_batch=4)
    requests = [([*prompt(4, 21), bad], 6), (good, 6)]
    if not bad_first:
        requests.reverse()
    ids = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in requests]
    bad_id, good_id = ids if bad_first else ids[::-1]
    streams = drain(engine)
    assert_failed(streams[bad_id], f"token {bad} poisons this model")
    assert len(streams[bad_id]) == 1
    assert tokens_of(streams[good_id]) == alone(model, good, 6)
    stats = engine.stats()
    assert (stats.failed, stats.aborted, stats.finished) == (1, 0, 1)
    assert parse(render(stats, RequestCounter()))["dikkat_requests_failed_total"] == 1
    assert_serves_on(engine, model)


def decode_failure(path: str, monkeypatch: pytest.MonkeyPatch, model: GPT, **kwargs) -> Engine:
    """An engine whose decode raises for a row at position K: through the model's forward
    (the eager decode), or through its pool step (the path of ``compile=True``, run eagerly:
    compiling takes about a minute)."""

    def hook(module, args, kwargs):
        rows = at_position(K, kwargs)
        if rows is not None and bool(rows.any()):
            raise RuntimeError(f"position {K} breaks this model")

    if path == "eager":
        return engine_with(model, hook, **kwargs)

    def pool_step(self, keys, values, *, compile=False):
        step = PoolStep(self, keys, values)

        def run(tokens, positions, slots):
            if bool((positions == K).any()):
                raise RuntimeError(f"position {K} breaks this model")
            return step(tokens, positions, slots)

        return run

    monkeypatch.setattr(GPT, "pool_step", pool_step)
    return Engine(model, block_size=4, compile=True, **kwargs)


@pytest.mark.parametrize("path", ["eager", "pool"])
def test_a_decode_that_raises_fails_its_row_alone(path, monkeypatch):
    model = make_gpt(seed=3)
    engine = decode_failure(path, monkeypatch, model, max_batch=4)
    # the first and last never reach position K; the middle one does, in a batch of three
    requests = [(prompt(3, 30), 5), (prompt(6, 31), 10), (prompt(4, 32), 5)]
    ids = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in requests]
    streams = drain(engine)
    bad = streams[ids[1]]
    assert_failed(bad, f"position {K} breaks this model")
    # its tokens until then are its own: the first from the prefill, one per position < K
    assert tokens_of(bad[:-1]) == alone(model, *requests[1])[: K - len(requests[1][0]) + 1]
    for rid, (p, n) in zip(ids[::2], requests[::2], strict=True):
        assert tokens_of(streams[rid]) == alone(model, p, n)
    stats = engine.stats()
    assert (stats.failed, stats.aborted, stats.finished) == (1, 0, 2)
    assert_serves_on(engine, model)


@pytest.mark.parametrize("where", ["prefill", "prompt_logprobs", "decode"])
def test_non_finite_logits_fail_their_request_alone(where):
    model = make_gpt(seed=4)
    good, other = (prompt(3, 50), 5), (prompt(6, 51), 8)
    bad = unused(model, [good, other, (prompt(5, 40), 4)])

    def nan_rows(module, args, kwargs, logits):
        if where == "decode":  # the row fed at position K
            rows = at_position(K, kwargs)
            return None if rows is None else logits.masked_fill(rows.view(-1, 1, 1), math.nan)
        at = args[0] == bad  # (B, T): where the bad id is fed
        if logits.shape[1] != at.shape[1]:  # the last position's logits alone
            at = at.any(dim=1, keepdim=True)
        return logits.masked_fill(at[..., None], math.nan)

    engine = engine_with(model, nan_rows, forward=True, max_batch=4)
    sick = other[0] if where == "decode" else [*other[0][:3], bad, *other[0][3:]]
    scored = SamplingParams(max_new_tokens=other[1], prompt_logprobs=where == "prompt_logprobs")
    ids = [
        engine.submit(good[0], SamplingParams(max_new_tokens=good[1])),
        engine.submit(sick, scored),
    ]
    streams = drain(engine)
    position = {"decode": K, "prefill": len(sick) - 1, "prompt_logprobs": 3}[where]
    assert_failed(streams[ids[1]], f"not finite (NaN or inf) at position {position}")
    assert tokens_of(streams[ids[0]]) == alone(model, *good)
    stats = engine.stats()
    assert (stats.failed, stats.aborted, stats.finished) == (1, 0, 1)
    assert_serves_on(engine, model)


@pytest.mark.parametrize("shared_in_step", [True, False])
def test_a_failed_prefill_leaves_no_unwritten_block_in_the_prefix_cache(shared_in_step):
    model = make_gpt(seed=5)
    common = prompt(8, 60)  # two full blocks of 4
    follower, later, other = common + prompt(3, 61), common + prompt(2, 62), prompt(5, 63)
    bad = unused(model, [(follower, 5), (later, 5), (other, 5), (prompt(5, 40), 4)])
    engine = engine_with(model, raise_on(bad), max_batch=4)
    # the failed request is admitted first: its blocks for `common` are indexed, never written
    failing = engine.submit([*common, bad, 1], SamplingParams(max_new_tokens=5))
    second = follower if shared_in_step else other  # shares them in the same step, or not
    rid = engine.submit(second, SamplingParams(max_new_tokens=5))
    streams = drain(engine)
    assert_failed(streams[failing], "poisons this model")
    assert tokens_of(streams[rid]) == alone(model, second, 5)
    hits = engine.stats().prefix_hit_tokens
    # the follower computed the shared blocks again: its hits were not hits
    assert hits == 0
    rid = engine.submit(later, SamplingParams(max_new_tokens=5))
    assert tokens_of(drain(engine)[rid]) == alone(model, later, 5)
    # the follower wrote the blocks, which serve again; unwritten, they were forgotten
    assert engine.stats().prefix_hit_tokens == (8 if shared_in_step else 0)
    assert (engine.stats().failed, engine.stats().aborted) == (1, 0)


def test_the_runner_sends_a_failure_to_the_failed_request_only():
    model = make_gpt(seed=6)
    good = prompt(5, 70)
    bad = unused(model, [(good, 6), (prompt(5, 40), 4)])
    engine = engine_with(model, raise_on(bad), max_batch=4)

    async def main() -> tuple[list, list, EngineRunner]:
        runner = EngineRunner(engine, idle_wait=0.01)
        # both queued before the worker starts: they share its first step
        _, bad_queue = runner.submit([*prompt(3, 71), bad], SamplingParams(max_new_tokens=6))
        _, good_queue = runner.submit(good, SamplingParams(max_new_tokens=6))
        runner.start()
        try:
            got_bad = [await asyncio.wait_for(bad_queue.get(), 10)]
            got_good = [await asyncio.wait_for(good_queue.get(), 10)]
            while got_good[-1].finish_reason is None:
                got_good.append(await asyncio.wait_for(good_queue.get(), 10))
            await asyncio.sleep(0.05)  # anything more would have arrived by now
            got_bad += [bad_queue.get_nowait() for _ in range(bad_queue.qsize())]
            assert runner.alive
        finally:
            runner.stop()
        return got_bad, got_good, runner

    got_bad, got_good, runner = asyncio.run(main())
    assert len(got_bad) == 1 and isinstance(got_bad[0], Failure)
    assert f"token {bad} poisons this model" in got_bad[0].message
    assert not any(isinstance(e, Failure) for e in got_good)
    assert tokens_of(got_good) == alone(model, good, 6)
    assert runner.error is None  # the engine did not fail, one request did
    assert (engine.stats().failed, engine.stats().aborted) == (1, 0)


def test_a_forgotten_block_leaves_the_prefix_index_and_frees_when_evictable():
    alloc = BlockAllocator(3)
    used, idle = alloc.allocate(), alloc.allocate()
    alloc.register(used, b"a")
    alloc.register(idle, b"b")
    alloc.release(idle)  # evictable: indexed, count 0
    alloc.forget(idle)
    alloc.forget(used)
    alloc.forget(used)  # not indexed any more: nothing to do
    assert (alloc.lookup(b"a"), alloc.lookup(b"b"), alloc.cached_count) == (None, None, 0)
    assert alloc.free_count == 2 and not alloc.is_evictable(idle)
    alloc.release(used)
    assert alloc.free_count == 3
