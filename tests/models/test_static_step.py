"""The static decode step (dikkat.models.static_step): the eager step's logits and tokens, with
sliding windows, query/key norms and grouped heads; compiled once for every later step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dikkat.generation import generate
from dikkat.generation.generate import decode_step, prefill
from dikkat.models import GPT, Decoder, DecoderConfig, GPTConfig
from dikkat.models.static_step import StaticStep

CONFIGS = {
    "llama": DecoderConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2),
    "gemma3": DecoderConfig.preset(
        "gemma3-270m", vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48,
        n_layers=3, sliding_window=4, layer_kinds=("sliding", "full", "sliding"), max_len=64,
    ),
    "gpt2": GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_len=64),
    "gpt-rope": GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                          position="rope", max_len=64),
}  # fmt: skip


def build(family: str) -> Decoder | GPT:
    config = CONFIGS[family]
    return (GPT if isinstance(config, GPTConfig) else Decoder)(config).eval()


@pytest.mark.parametrize("family", CONFIGS)
def test_static_steps_give_the_eager_steps_logits(family):
    torch.manual_seed(0)
    model = build(family)
    ids = torch.randint(0, 64, (2, 5))
    eager, static = model.new_cache(2, 16), model.new_cache(2, 16)
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
