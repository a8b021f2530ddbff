"""The engine serves any decoder of the protocol (a GPT, a Llama- and a Gemma-like Decoder) as
``generate`` decodes it alone, with what a server needs beyond tokens: log-probabilities of the
new tokens and of the prompt (against an fp64 teacher-forced forward), scoring without
generating (``max_new_tokens = 0``), penalties and biases, and refusals of what it leaves to
others (``n``, stop strings)."""

from __future__ import annotations

import pytest
import torch

import dikkat.serving.paged
from dikkat.generation import DecoderLM, SamplingParams, generate
from dikkat.models import GPT, Decoder, DecoderConfig, GPTConfig
from dikkat.models.decoder import gemma3_layer_kinds
from dikkat.serving import Engine, TokenEvent
from helpers import scramble

V = 53

GEMMA_LIKE = DecoderConfig(
    family="gemma3", vocab_size=V, max_len=48, d_model=32, n_layers=6, n_heads=4, n_kv_heads=1,
    head_dim=16, d_ff=48, activation="gelu_tanh", rope_base=1e6, local_rope_base=1e4,
    sliding_window=5, layer_kinds=gemma3_layer_kinds(6), qk_norm=True, sandwich_norm=True,
    embed_scale=True, attn_scale=0.25,
)  # fmt: skip
LLAMA_LIKE = DecoderConfig(vocab_size=V, max_len=48, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, d_ff=48, qkv_bias=True)  # fmt: skip


def make(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT(GPTConfig(vocab_size=V, max_len=48, d_model=32, n_layers=2, n_heads=4))
    else:
        model = Decoder(GEMMA_LIKE if kind == "gemma" else LLAMA_LIKE)
    return scramble(model, 0).eval()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[int, list]:
    """Submit every request at once, step until all end; each request's events in order."""
    ids = [engine.submit(p, params) for p, params in requests]
    events: dict[int, list[TokenEvent]] = {i: [] for i in ids}
    for _ in range(200):
        if not engine.has_work():
            break
        for e in engine.step():
            events[e.request_id].append(e)
    assert not engine.has_work()
    return [events[i] for i in ids]  # type: ignore[return-value]


def fp64_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """log_softmax of an fp64 copy's logits over the whole text (no cache): row i predicts
    token i + 1."""
    copy = make("gpt" if isinstance(model, GPT) else "gemma" if model.config.family == "gemma3"
                else "llama").double()  # fmt: skip
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        return torch.log_softmax(copy(torch.tensor([tokens]))[0], dim=-1)


@pytest.mark.parametrize("kind", ["gpt", "llama", "gemma"])
def test_every_decoder_family_is_served_as_generate_decodes_it_alone(kind):
    model = make(kind)
    assert isinstance(model, DecoderLM)
    requests = [
        (prompt(3 + 5 * i, i), SamplingParams(max_new_tokens=4 + 3 * i, temperature=t, seed=i))
        for i, t in enumerate([0.0, 0.9, 0.0, 1.3])
    ]
    requests.append((requests[0][0] + [1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=5)))
    engine = Engine(model, block_size=4, max_batch=3)  # a queue, and prefixes shared
    for (p, params), events in zip(requests, run(engine, requests), strict=True):
        assert [e.token for e in events] == generate(model, [p], params)[0][len(p) :]
    assert engine.stats().free_blocks == engine.num_blocks


@pytest.mark.parametrize("kind", ["gpt", "gemma"])
def test_a_compiled_engine_decodes_as_the_eager_one(kind):
    """compile=True: the model's compiled pool step, one graph for batches that change as
    requests join and leave (learned positions; sliding windows, grouped heads)."""
    model = make(kind)
    requests = [(prompt(3 + 5 * i, i), SamplingParams(max_new_tokens=4 + 3 * i)) for i in range(4)]
    requests.append((requests[0][0] + [1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=5)))
    compiled = Engine(model, block_size=4, max_batch=3, compile=True)
    compiled.warm_up()
    assert compiled.stats().generated_tokens == 0  # the warm-up's requests are forgotten
    eager = Engine(model, block_size=4, max_batch=3)
    for want, got in zip(run(eager, requests), run(compiled, requests), strict=True):
        assert [e.token for e in got] == [e.token for e in want]
    assert compiled.stats().free_blocks == compiled.num_blocks
    compiled.submit([1], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        compiled.warm_up()


@pytest.mark.parametrize("kind", ["gpt", "gemma"])
def test_logprobs_are_the_models_own_against_an_fp64_forward(kind):
    model = make(kind)
    p = prompt(9, 1)
    params = SamplingParams(
        max_new_tokens=6,
        logprobs=True,
        top_logprobs=3,
        prompt_logprobs=True,
        temperature=0.8,
        seed=2,
    )
    (events,) = run(Engine(model, block_size=4), [(p, params)])
    new = [e.token for e in events]
    exact = fp64_logprobs(model, p + new)
    prompt_lp = events[0].prompt_logprobs
    assert prompt_lp is not None and prompt_lp[0] is None and len(prompt_lp) == len(p)
    assert all(e.prompt_logprobs is None for e in events[1:])
    scored = [*prompt_lp[1:], *(e.logprob for e in events)]
    for i, item in enumerate(scored):  # token i + 1 of the whole text
        assert item is not None and item.token == (p + new)[i + 1]
        assert abs(item.logprob - exact[i, item.token].item()) < 1e-4
        top = exact[i].topk(3)
        assert [t for t, _ in item.top] == top.indices.tolist()
        assert (
            max(abs(lp - v) for (_, lp), v in zip(item.top, top.values.tolist(), strict=True))
            < 1e-4
        )


def test_scoring_alone_generates_nothing_and_ignores_cached_prefixes():
    model = make("llama")
    p = prompt(13, 3)
    engine = Engine(model, block_size=4)
    run(engine, [(p, SamplingParams(max_new_tokens=2))])  # its blocks stay cached
    hits = engine.stats().prefix_hit_tokens
    (events,) = run(engine, [(p, SamplingParams(max_new_tokens=0, prompt_logprobs=True))])
    assert len(events) == 1 and events[0].token is None and events[0].finish_reason == "length"
    assert engine.stats().prefix_hit_tokens == hits  # every prompt token was computed
    exact = fp64_logprobs(model, p)
    lps = events[0].prompt_logprobs
    assert lps is not None and lps[0] is None
    assert max(abs(lp.logprob - exact[i, p[i + 1]].item()) for i, lp in enumerate(lps[1:])) < 1e-4
    assert engine.stats().free_blocks == engine.num_blocks


def test_penalties_biases_and_stops_equal_generate_in_a_batch():
    model = make("gpt")
    requests = [
        (prompt(5, 0), SamplingParams(max_new_tokens=10, frequency_penalty=1.2)),
        (
            prompt(7, 1),
            SamplingParams(max_new_tokens=9, presence_penalty=2.0, temperature=1.0, seed=4),
        ),
        (prompt(4, 2), SamplingParams(max_new_tokens=8, logit_bias={3: 4.0}, stop_ids=(3,))),
    ]
    for (p, params), events in zip(
        requests, run(Engine(model, block_size=4), requests), strict=True
    ):
        assert [e.token for e in events] == generate(model, [p], params)[0][len(p) :]


def test_the_engine_refuses_what_it_leaves_to_others():
    engine = Engine(make("gpt"), block_size=4)
    with pytest.raises(ValueError, match="the engine cannot honour n=2: decode each of"):
        engine.submit([1, 2], SamplingParams(n=2))
    with pytest.raises(ValueError, match=r"the engine cannot honour stop=\('x',\)"):
        engine.submit([1, 2], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="logit_bias names token 53"):
        engine.submit([1, 2], SamplingParams(logit_bias={53: 1.0}))
    with pytest.raises(TypeError, match="model must be a decoder"):
        Engine(torch.nn.Linear(2, 2))


def test_the_default_pool_fits_its_memory_budget(monkeypatch):
    model = make("llama")  # 2 layers · 2 kv heads · head dim 8, fp32: 256 bytes a slot
    assert Engine(model, block_size=4, max_batch=2).num_blocks == 2 * 48 // 4  # whole contexts
    monkeypatch.setattr(dikkat.serving.paged, "DEFAULT_CACHE_BYTES", 4 * 1024)
    engine = Engine(model, block_size=4, max_batch=2)
    assert engine.num_blocks == 4 and engine._pool.nbytes == 4 * 1024
