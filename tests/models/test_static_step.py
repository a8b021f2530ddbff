"""The static decode step (dikkat.models.static_step): the eager step's logits and tokens, with
sliding windows, query/key norms and grouped heads; compiled once for every later step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from step_models import CONFIGS, build

from dikkat.generation import generate
from dikkat.generation.generate import decode_step, prefill
from dikkat.models import Decoder
from dikkat.models.static_step import PoolStep, StaticStep


@pytest.mark.parametrize("rows", [1, 2])  # one row attends in the native kernel, where built
@pytest.mark.parametrize("family", CONFIGS)
def test_static_steps_give_the_eager_steps_logits(family, rows):
    torch.manual_seed(0)
    model = build(family)
    ids = torch.randint(0, 64, (rows, 5))
    eager, static = model.new_cache(rows, 16), model.new_cache(rows, 16)
    tokens = prefill(model, ids, eager).argmax(-1)
    assert torch.equal(prefill(model, ids, static).argmax(-1), tokens)
    step = StaticStep(model, static)
    for slot in range(5, 14):  # past the 4-key window of the sliding layers
        want = decode_step(model, tokens, eager, slot)
        got = step(tokens, slot)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        tokens = want.argmax(-1)
    assert static[0].length == eager[0].length == 14


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_a_compiled_step_gives_the_eager_tokens(family):
    torch.manual_seed(0)
    model = build(family)
    prompt = [[3, 1, 4, 1, 5]]
    assert generate(model, prompt, 10, compile=True) == generate(model, prompt, 10)


def test_each_model_runs_its_own_compiled_graph():
    """The compiled step skips the guards on the model's attributes: a model of the same class
    and shapes but other settings, alive beside the first, must not be served its graph."""
    llama = CONFIGS["llama"]
    other = dataclasses.replace(llama, activation="gelu_tanh", rope_base=10.0, qk_norm=True)
    models = []
    for config in (llama, other):
        torch.manual_seed(0)
        models.append(Decoder(config).eval())
    for model in models:
        eager, static = model.new_cache(1, 16), model.new_cache(1, 16)
        tokens = prefill(model, torch.tensor([[3, 1, 4]]), eager).argmax(-1)
        prefill(model, torch.tensor([[3, 1, 4]]), static)
        want = decode_step(model, tokens, eager, 3)
        got = StaticStep(model, static, compile=True)(tokens, 3)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_bad_steps_are_refused():
    model = Decoder(CONFIGS["llama"]).eval()
    cache = model.new_cache(1, 8)
    step = StaticStep(model, cache)
    with pytest.raises(ValueError, match="the filled length"):
        step(torch.tensor([1]), 3)
    with pytest.raises(ValueError, match=r"tokens must be \(1,\)"):
        step(torch.tensor([1, 2]), 0)
    with pytest.raises(TypeError, match="one KVCache per layer"):
        StaticStep(model, cache[:1])
    with pytest.raises(ValueError, match="no padding"):
        generate(model, [[1, 2, 3], [4]], 2, compile=True)


def pooled(model, prompts, n_slots=64):
    """Each prompt prefilled alone (its eager cache), and the same keys and values scattered in
    a shared pool, at slots of a random permutation."""
    layout = model.cache_layout()
    keys = [torch.zeros(n_slots, layout.kv_heads, layout.head_dim) for _ in range(layout.n_layers)]
    values = [torch.zeros_like(k) for k in keys]
    slots = torch.randperm(n_slots)[: len(prompts) * 16].view(len(prompts), 16)
    caches, tokens = [], []
    for b, prompt in enumerate(prompts):
        cache = model.new_cache(1, 16)
        tokens.append(int(prefill(model, torch.tensor([prompt]), cache).argmax(-1)))
        n = len(prompt)
        for i, c in enumerate(cache):
            keys[i][slots[b, :n]] = c.k[0, :, :n].transpose(0, 1)
            values[i][slots[b, :n]] = c.v[0, :, :n].transpose(0, 1)
        caches.append(cache)
    return keys, values, slots, caches, tokens


@pytest.mark.parametrize("family", CONFIGS)
def test_pool_steps_give_each_rows_eager_logits(family):
    """Rows at positions of their own, keys in a shared pool: each row's logits are those of
    its eager step alone, past the sliding window too."""
    torch.manual_seed(0)
    model = build(family)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    keys, values, slots, caches, tokens = pooled(model, prompts)
    step = PoolStep(model, keys, values)
    positions = torch.tensor([len(p) for p in prompts])
    for _ in range(8):
        got = step(torch.tensor(tokens), positions, slots[:, : int(positions.max()) + 1])
        for b, cache in enumerate(caches):
            want = decode_step(model, torch.tensor([tokens[b]]), cache, int(positions[b]))[0]
            assert (got[b] - want).abs().max() <= 1e-5 * want.abs().max()
            tokens[b] = int(want.argmax())
        positions += 1


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_a_compiled_pool_step_serves_batches_that_change(family):
    """One compiled step as rows join and leave and grow: the eager pool step's logits."""
    torch.manual_seed(0)
    model = build(family)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    keys, values, slots, _, tokens = pooled(model, prompts)
    eager_keys, eager_values = [k.clone() for k in keys], [v.clone() for v in values]
    eager = PoolStep(model, eager_keys, eager_values)
    compiled = PoolStep(model, keys, values, compile=True)
    positions = torch.tensor([len(p) for p in prompts])
    for rows in ([0, 1, 2], [0, 2], [1], [0, 1, 2], [2]):
        r = torch.tensor(rows)
        S = int(positions[r].max()) + 1
        args = (torch.tensor(tokens)[r], positions[r], slots[r, :S])
        want = eager(*args)
        got = compiled(*args)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        for b, logits in zip(rows, want, strict=True):
            tokens[b] = int(logits.argmax())
        positions[r] += 1
    for a, b in zip(keys + values, eager_keys + eager_values, strict=True):  # the same writes
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_bad_pool_steps_are_refused():
    model = Decoder(CONFIGS["llama"]).eval()
    keys = [torch.zeros(8, 2, 8) for _ in range(2)]
    step = PoolStep(model, keys, keys)
    with pytest.raises(ValueError, match="must agree"):
        step(torch.tensor([1, 2]), torch.tensor([0]), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must lie in 0 … 2"):
        step(torch.tensor([1]), torch.tensor([3]), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="slots must lie in 0 … 7"):
        step(torch.tensor([1]), torch.tensor([0]), torch.tensor([[8, 0]]))
    with pytest.raises(TypeError, match="positions must be an int64 tensor"):
        step(torch.tensor([1]), torch.tensor([0.0]), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens must lie in 0 … 63"):
        step(torch.tensor([64]), torch.tensor([0]), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"one \(N, 2, 8\) pool per layer \(2\)"):
        PoolStep(model, keys[:1], keys[:1])
