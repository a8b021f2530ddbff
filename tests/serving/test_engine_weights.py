"""The engine's weights: it serves an inference copy made when it is built (docs/engine.md), so
the model it was given is left as it was, however the engine's requests end, and the answers,
prefix cache included, stay those of the weights the engine was built with.
"""

from __future__ import annotations

import pytest
import torch

from dikkat.generation import generate
from dikkat.models import GPT, GPTConfig
from dikkat.serving import Engine, SamplingParams, TokenEvent
from helpers import scramble

V = 61


def make_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=V, max_len=48, d_model=32, n_layers=2, n_heads=4)
    return scramble(GPT(config), seed)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(engine: Engine, tokens: list[int], n: int) -> list[int]:
    """One request served to its end: its tokens."""
    rid = engine.submit(tokens, SamplingParams(max_new_tokens=n))
    events: list[TokenEvent] = []
    for _ in range(n + 1):
        events += [e for e in engine.step() if e.request_id == rid]
        if not engine.has_work():
            break
    assert not engine.has_work()
    return [e.token for e in events]


@pytest.mark.parametrize("last", ["finished", "aborted"])
def test_the_model_multiplies_its_own_weights_after_the_engine_is_done(last):
    """However the engine's last request ends, a forward of the model afterwards is the fp32
    forward of its own parameters, to the bit."""
    model = make_gpt(seed=1)
    ids = torch.tensor([prompt(12, seed=2)])
    with torch.no_grad():
        before = model(ids)
    engine = Engine(model, block_size=4, weights="int8")
    engine.submit(prompt(6, seed=3), SamplingParams(max_new_tokens=3))
    second = engine.submit(prompt(9, seed=4), SamplingParams(max_new_tokens=8))
    for _ in range(3):
        engine.step()  # the first request ends, the second runs on
    if last == "aborted":
        engine.abort(second)
    else:
        while engine.has_work():
            engine.step()
    assert not engine.has_work()
    assert (engine.stats().finished, engine.stats().aborted) == (
        (2, 0) if last == "finished" else (1, 1)
    )
    with torch.no_grad():
        after = model(ids)
    assert torch.equal(after, before)
    # the engine goes on serving int8 answers
    int8 = serve(engine, prompt(9, seed=4), 8)
    assert int8 == generate(model, [prompt(9, seed=4)], 8, weights="int8")[0][9:]


def test_the_engine_serves_the_weights_it_was_built_with_prefix_cache_included():
    """After ``load_state_dict`` of other weights into the model, the engine answers a prompt it
    has cached with the tokens of the weights it was built with, as it did before; a new engine
    serves the new weights."""
    model = make_gpt(seed=5)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = prompt(13, seed=6)  # three blocks of 4 kept in the prefix cache
    engine = Engine(model, block_size=4)
    before = serve(engine, tokens, 6)
    assert before == generate(model, [tokens], 6)[0][13:]
    model.load_state_dict(make_gpt(seed=7).state_dict())
    new = generate(model, [tokens], 6)[0][13:]
    assert new != before  # the new weights answer otherwise
    hits = engine.stats().prefix_hit_tokens
    again = serve(engine, tokens, 6)
    assert engine.stats().prefix_hit_tokens == hits + 12  # the cached blocks were used
    assert again == before
    assert serve(Engine(model, block_size=4), tokens, 6) == new
    model.load_state_dict(old)
    assert generate(model, [tokens], 6)[0][13:] == before
