"""The serving engine: each request's tokens equal ``generate()`` for its prompt alone, whatever
else runs beside it; blocks are shared, freed and waited for as documented (docs/engine.md).

The oracle is :func:`dikkat.generation.generate` on one prompt: its own KV cache, no batch, no
paging, the same seeded generator.
"""

from __future__ import annotations

import threading

import pytest
import torch

from dikkat.generation import generate
from dikkat.models import GPT, GPTConfig
from dikkat.serving import Engine, EngineFull, SamplingParams, TokenEvent
from dikkat.weights import InferenceLinear, w8a8_available
from helpers import scramble

V = 61

VARIANTS = {
    "learned": dict(position="learned"),
    "rope": dict(position="rope"),
    "gqa-rope": dict(position="rope", n_kv_heads=2),
}

W8A8 = pytest.param(
    "w8a8", marks=pytest.mark.skipif(not w8a8_available(), reason="needs FBGEMM (x86)")
)


def make_gpt(variant: str = "rope", seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=V, max_len=48, d_model=32, n_layers=2, n_heads=4)
    config = GPTConfig(**{**config.__dict__, **VARIANTS[variant]})
    return scramble(GPT(config), seed)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model: GPT, tokens: list[int], p: SamplingParams) -> list[int]:
    """The request's tokens from generate() on its prompt alone."""
    return generate(model, [tokens], p)[0][len(tokens) :]


def drain(engine: Engine, streams: dict[int, list[TokenEvent]], submit_at=None) -> int:
    """Step until the engine is idle, collecting events; ``submit_at[step]()`` runs before that
    step. Returns the most sequences seen running at once."""
    most, step = 0, 0
    submit_at = submit_at or {}
    while engine.has_work() or step in submit_at:
        if step in submit_at:
            submit_at[step]()
        for event in engine.step():
            streams.setdefault(event.request_id, []).append(event)
        most = max(most, engine.stats().running)
        step += 1
    return most


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [e.token for e in events]


def assert_finished_once(events: list[TokenEvent]) -> None:
    assert [e.finish_reason is not None for e in events] == [False] * (len(events) - 1) + [True]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_requests_joining_and_leaving_equal_generate_alone(variant):
    model = make_gpt(variant, seed=1)
    engine = Engine(model, block_size=4, max_batch=3)
    requests = [
        (prompt(9, 1), SamplingParams(max_new_tokens=10)),
        (prompt(2, 2), SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)),
        (prompt(13, 3), SamplingParams(max_new_tokens=12)),
        (prompt(5, 4), SamplingParams(max_new_tokens=5, temperature=0.8, top_k=5, seed=9)),
        (prompt(1, 5), SamplingParams(max_new_tokens=15, temperature=1.2, top_p=0.9, seed=1)),
        (prompt(20, 6), SamplingParams(max_new_tokens=3)),
    ]
    ids: dict[int, int] = {}

    def submit(*which: int):
        def run():
            for i in which:
                ids[engine.submit(*requests[i])] = i

        return run

    streams: dict[int, list[TokenEvent]] = {}
    most = drain(engine, streams, {0: submit(0, 1), 2: submit(2, 3, 4), 7: submit(5)})
    assert most == 3  # the batch really ran several sequences at once (and no more)
    assert sorted(ids.values()) == list(range(len(requests)))
    for rid, i in ids.items():
        tokens, params = requests[i]
        assert tokens_of(streams[rid]) == alone(model, tokens, params), i
        assert_finished_once(streams[rid])
        assert streams[rid][-1].finish_reason == "length"
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks
    assert (stats.finished, stats.aborted, stats.running, stats.waiting) == (6, 0, 0, 0)
    assert stats.generated_tokens == sum(p.max_new_tokens for _, p in requests)
    assert stats.prompt_tokens == sum(len(t) for t, _ in requests)


def test_a_stop_token_ends_the_request_and_is_sent():
    model = make_gpt(seed=2)
    tokens = prompt(6, 7)
    free_run = alone(model, tokens, SamplingParams(max_new_tokens=12))
    stop = free_run[3]
    params = SamplingParams(max_new_tokens=12, stop_ids=(V - 1, stop))
    engine = Engine(model, block_size=4)
    rid = engine.submit(tokens, params)
    streams: dict[int, list[TokenEvent]] = {}
    drain(engine, streams)
    got = tokens_of(streams[rid])
    assert got == free_run[: free_run.index(stop) + 1]
    assert got == alone(model, tokens, SamplingParams(max_new_tokens=12, stop_ids=(stop,)))
    assert streams[rid][-1].finish_reason == "stop"
    assert_finished_once(streams[rid])


def test_a_shared_prompt_prefix_is_computed_once_and_changes_no_token():
    model = make_gpt(seed=3)
    common = prompt(14, 8)
    a, b = common + prompt(3, 9), common + prompt(5, 10)
    engine = Engine(model, block_size=4, max_batch=4)
    greedy, sampled = SamplingParams(max_new_tokens=8), SamplingParams(8, temperature=1.0, seed=5)
    streams: dict[int, list[TokenEvent]] = {}
    ra = engine.submit(a, greedy)
    rb = engine.submit(b, sampled)  # admitted in the same step as a, after it
    drain(engine, streams)
    assert engine.stats().prefix_hit_tokens == 12  # the 3 full blocks of the common 14
    assert tokens_of(streams[ra]) == alone(model, a, greedy)
    assert tokens_of(streams[rb]) == alone(model, b, sampled)
    # a's blocks outlive it as cached prefixes: a later request finds them, and they count free
    assert engine.stats().free_blocks == engine.stats().total_blocks
    rc = engine.submit(a, greedy)
    drain(engine, streams)
    assert engine.stats().prefix_hit_tokens == 12 + 16  # a's 4 full blocks (its 17th token: new)
    assert tokens_of(streams[rc]) == tokens_of(streams[ra])


def test_an_identical_prompt_that_fills_its_blocks_still_computes_its_last_token():
    model = make_gpt(seed=4)
    tokens = prompt(8, 11)  # exactly two blocks
    engine = Engine(model, block_size=4)
    streams: dict[int, list[TokenEvent]] = {}
    first = engine.submit(tokens, SamplingParams(max_new_tokens=4))
    drain(engine, streams)
    second = engine.submit(tokens, SamplingParams(max_new_tokens=4))
    drain(engine, streams)
    assert engine.stats().prefix_hit_tokens == 4  # the first block; the second holds the last
    assert tokens_of(streams[second]) == tokens_of(streams[first])
    assert tokens_of(streams[first]) == alone(model, tokens, SamplingParams(max_new_tokens=4))


def test_abort_frees_the_blocks_of_waiting_and_running_requests():
    model = make_gpt(seed=5)
    engine = Engine(model, block_size=4, max_batch=2)
    keep = engine.submit(prompt(5, 12), SamplingParams(max_new_tokens=10))
    running = engine.submit(prompt(9, 13), SamplingParams(max_new_tokens=10))
    waiting = engine.submit(prompt(3, 14), SamplingParams(max_new_tokens=10))
    streams: dict[int, list[TokenEvent]] = {}
    for _ in range(3):
        for e in engine.step():
            streams.setdefault(e.request_id, []).append(e)
    before = engine.stats()
    assert (before.running, before.waiting) == (2, 1)
    engine.abort(waiting)
    engine.abort(running)
    engine.abort(running)  # twice: no error, counted once
    engine.abort(12345)  # unknown: no error
    after = engine.stats()
    assert (after.running, after.waiting, after.aborted) == (1, 0, 2)
    assert after.free_blocks > before.free_blocks
    sent = len(streams[running])
    drain(engine, streams)
    assert len(streams[running]) == sent  # nothing more of it
    assert waiting not in streams
    assert tokens_of(streams[keep]) == alone(
        model, prompt(5, 12), SamplingParams(max_new_tokens=10)
    )
    engine.abort(keep)  # finished: no error, not counted
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks
    assert (stats.finished, stats.aborted) == (1, 2)


def test_abort_from_another_thread_during_a_step_drops_its_events():
    model = make_gpt(seed=6)
    # abort while the model runs: from inside the first layer's forward, on another thread (the
    # hook is the model's when the engine copies it, so its copy runs it too)
    armed, hook_fired = [], []

    def abort_now(module, args):
        if armed and not hook_fired:
            t = threading.Thread(target=engine.abort, args=(victim,))
            t.start()
            t.join()
            hook_fired.append(True)

    handle = model.blocks[0].register_forward_pre_hook(abort_now)
    engine = Engine(model, block_size=4)
    handle.remove()
    victim = engine.submit(prompt(4, 15), SamplingParams(max_new_tokens=20))
    other = engine.submit(prompt(4, 16), SamplingParams(max_new_tokens=20))
    engine.step()
    armed.append(True)
    events = engine.step()
    assert hook_fired
    assert [e.request_id for e in events] == [other]
    assert engine.stats().running == 1
    drain(engine, {})
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_submit_raises_engine_full_at_max_queue():
    engine = Engine(make_gpt(), block_size=4, max_batch=1, max_queue=2)
    params = SamplingParams(max_new_tokens=3)
    engine.submit([1, 2], params)
    engine.submit([3], params)
    with pytest.raises(EngineFull, match="max_queue=2"):
        engine.submit([4], params)
    engine.step()  # admits one: room in the queue again
    engine.submit([4], params)
    assert engine.stats().waiting == 2


def test_requests_take_blocks_as_they_grow_and_the_last_admitted_is_preempted():
    """6 blocks of 4 slots: the first request will fill 5 (8 + 12 − 1 slots), the second 4 (6 +
    9 − 1). Both are admitted (their prompts fit); when a block runs out, the one admitted last
    goes back to the queue, and when it is admitted again it goes on where it stopped: each
    request's tokens are its tokens alone, a seeded draw's included."""
    model = make_gpt(seed=7)
    engine = Engine(model, block_size=4, num_blocks=6, max_batch=4)
    first = (prompt(8, 17), SamplingParams(max_new_tokens=12, temperature=1.0, seed=2))
    second = (prompt(6, 18), SamplingParams(max_new_tokens=9, temperature=1.0, seed=3))
    r1, r2 = engine.submit(*first), engine.submit(*second)
    streams: dict[int, list[TokenEvent]] = {}
    for event in engine.step():
        streams.setdefault(event.request_id, []).append(event)
    assert (engine.stats().running, engine.stats().waiting) == (2, 0)
    most = drain(engine, streams)
    assert most == 2
    assert engine.stats().preempted >= 1
    assert tokens_of(streams[r1]) == alone(model, *first)
    assert tokens_of(streams[r2]) == alone(model, *second)
    assert engine.stats().free_blocks == 6
    assert engine.stats().prompt_tokens == 8 + 6  # a preempted prompt is counted once


def test_requests_that_may_run_to_the_context_s_end_run_together():
    """What a chat without max_tokens asks: each may fill 10 of the 16 blocks, yet all four run
    at once (each holds what it has written), and each makes its tokens alone."""
    model = make_gpt(seed=11)
    engine = Engine(model, block_size=4, num_blocks=16, max_batch=4)
    room = model.config.max_len - 3
    requests = [(prompt(3, 40 + i), SamplingParams(max_new_tokens=room)) for i in range(4)]
    ids = [engine.submit(*r) for r in requests]
    streams: dict[int, list[TokenEvent]] = {}
    for event in engine.step():
        streams.setdefault(event.request_id, []).append(event)
    assert engine.stats().running == 4
    drain(engine, streams)
    for rid, r in zip(ids, requests, strict=True):
        assert tokens_of(streams[rid]) == alone(model, *r)


def test_a_lone_request_never_preempts_itself_and_a_full_pool_admits_none():
    """The one request that fills the pool runs alone to its end; a second waits for it."""
    model = make_gpt(seed=9)
    engine = Engine(model, block_size=4, num_blocks=4, max_batch=4)
    whole = (prompt(5, 30), SamplingParams(max_new_tokens=12))  # 16 slots: every block
    other = (prompt(3, 31), SamplingParams(max_new_tokens=4))
    r1, r2 = engine.submit(*whole), engine.submit(*other)
    streams: dict[int, list[TokenEvent]] = {}
    drain(engine, streams)
    assert tokens_of(streams[r1]) == alone(model, *whole)
    assert tokens_of(streams[r2]) == alone(model, *other)
    assert engine.stats().free_blocks == 4


def test_submit_from_another_thread_while_stepping():
    model = make_gpt(seed=8)
    engine = Engine(model, block_size=4, max_batch=3)
    requests = [(prompt(3 + i, 20 + i), SamplingParams(max_new_tokens=6)) for i in range(6)]
    ids: dict[int, int] = {}

    def client():
        for i, r in enumerate(requests):
            ids[engine.submit(*r)] = i

    t = threading.Thread(target=client)
    t.start()
    streams: dict[int, list[TokenEvent]] = {}
    while t.is_alive() or engine.has_work():
        for e in engine.step():
            streams.setdefault(e.request_id, []).append(e)
    t.join()
    for rid, i in ids.items():
        assert tokens_of(streams[rid]) == alone(model, *requests[i]), i


def test_bad_requests_name_the_argument():
    engine = Engine(make_gpt(), block_size=4)
    ok = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit([], ok)
    with pytest.raises(ValueError, match=r"prompt\[1\] is 61, outside the vocabulary of 61"):
        engine.submit([1, 61], ok)
    with pytest.raises(TypeError, match=r"prompt\[0\]"):
        engine.submit([1.0], ok)
    with pytest.raises(TypeError, match="prompt must be a list"):
        engine.submit("hello", ok)
    with pytest.raises(
        ValueError, match=r"40 tokens and max_new_tokens=9: 49 positions.*context of 48"
    ):
        engine.submit([1] * 40, SamplingParams(max_new_tokens=9))
    with pytest.raises(ValueError, match=r"eos_id=61, in stop_ids=\(61,\)\) is outside"):
        engine.submit([1], SamplingParams(max_new_tokens=2, stop_ids=(61,)))
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.submit([1], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="num_blocks=2"):
        Engine(make_gpt(), block_size=4, num_blocks=2).submit([1] * 8, ok)
    assert engine.stats().waiting == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=1.5), TypeError, "max_new_tokens"),
        (dict(max_new_tokens=2, temperature=-1.0), ValueError, "temperature"),
        (dict(max_new_tokens=2, top_p=0.0), ValueError, "top_p"),
        (dict(max_new_tokens=2, top_k=0), ValueError, "top_k"),
        (dict(max_new_tokens=2, seed=-1), ValueError, "seed"),
        (dict(max_new_tokens=2, stop_ids=(-1,)), ValueError, "stop_ids"),
        (dict(max_new_tokens=2, stop_ids=3), TypeError, "stop_ids"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, error, name):
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)


def test_bad_engine_arguments_name_the_argument():
    with pytest.raises(TypeError, match="model must be a decoder"):
        Engine(torch.nn.Linear(2, 2))
    for name in ("block_size", "num_blocks", "max_batch", "max_queue"):
        with pytest.raises(ValueError, match=name):
            Engine(make_gpt(), **{name: 0})
    with pytest.raises(ValueError, match=r"weights must be one of .*'int4'"):
        Engine(make_gpt(), weights="int4")
    with pytest.raises(TypeError, match="compile must be True or False"):
        Engine(make_gpt(), compile="yes")


@pytest.mark.parametrize("weights", ["bf16", "int8", W8A8])
def test_a_weight_format_serves_what_generate_gives_in_it(weights):
    model = make_gpt("rope").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = Engine(model, block_size=4, weights=weights)
    prompts = [prompt(n, seed) for seed, n in enumerate((5, 11, 3))]
    params = SamplingParams(max_new_tokens=6)
    ids = [engine.submit(p, params) for p in prompts]
    streams: dict[int, list[TokenEvent]] = {}
    seen = []  # the format each linear layer multiplied in, at every call during the steps
    forward = InferenceLinear.forward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            InferenceLinear, "forward", lambda m, x: seen.append(m.weights_format) or forward(m, x)
        )
        drain(engine, streams)
    assert seen and set(seen) == {weights}
    assert not any(isinstance(m, InferenceLinear) for m in model.modules())
    for rid, tokens in zip(ids, prompts, strict=True):
        want = generate(model, [tokens], 6, weights=weights)[0][len(tokens) :]
        assert tokens_of(streams[rid]) == want, (weights, rid)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_default_pool_holds_max_batch_whole_contexts():
    engine = Engine(make_gpt(), block_size=5, max_batch=3)
    stats = engine.stats()
    assert (stats.total_blocks, stats.block_size) == (3 * 10, 5)  # ⌈48 / 5⌉ = 10 per sequence
    assert engine.max_len == 48 and isinstance(engine.model, GPT)


def test_a_model_that_raises_for_every_request_fails_each_alone_and_the_engine_goes_on():
    """Even a failure no request can be blamed for (the model raises for all, as a broken
    device would) ends each request with its own error; the waiting one is not dropped."""
    model = make_gpt(seed=9)
    failing = [True]

    def fail(module, args):
        if failing:
            raise RuntimeError("out of memory, say")

    handle = model.blocks[0].register_forward_pre_hook(fail)  # copied with the model
    engine = Engine(model, block_size=4, max_batch=1)
    handle.remove()
    first = engine.submit(prompt(9, 30), SamplingParams(max_new_tokens=4))
    second = engine.submit(prompt(9, 31), SamplingParams(max_new_tokens=4))
    (event,) = engine.step()  # the first ran alone and failed; the second still waits
    assert (event.request_id, event.finish_reason) == (first, "error")
    assert "out of memory, say" in event.error
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.failed, stats.aborted) == (0, 1, 1, 0)
    failing.clear()
    again = engine.submit(prompt(9, 30), SamplingParams(max_new_tokens=4))
    streams: dict[int, list[TokenEvent]] = {}
    drain(engine, streams)
    assert engine.stats().prefix_hit_tokens == 0  # nothing the failed prefill indexed is trusted
    for rid, text in ((second, prompt(9, 31)), (again, prompt(9, 30))):
        assert tokens_of(streams[rid]) == alone(model, text, SamplingParams(max_new_tokens=4))
    assert engine.stats().free_blocks == engine.stats().total_blocks
