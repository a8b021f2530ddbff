"""dikkat.hf.register: Hugging Face models run through dikkat.attention give eager's logits,
eager's greedy tokens and eager's gradients, on every dikkat backend (docs/hf.md).

Notation: ``B`` batch, ``T`` tokens, ``V`` vocabulary.

The oracle is transformers' own ``attn_implementation="eager"`` (the formula written out),
in float32, on randomly initialised tiny models built from configs (nothing downloaded):
GPT-2 (right padding, a scale of 1/(√D·(layer + 1))), BERT (padding through
``attention_mask``), Llama (grouped-query heads and RoPE, left padding), Mistral (a sliding
window shorter than the sequence, left padding), Gemma 2 (logit soft-capping, a sliding window
on every other layer, left padding) and gpt-oss (learned attention sinks passed as ``s_aux=``, a
sliding window on every other layer, left padding). A backend that cannot serve a model's calls
(sdpa can neither soft-cap nor add sinks) must refuse them with its reason, and the test is then
skipped with it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import dikkat.hf

transformers = pytest.importorskip("transformers")

BACKENDS = ["reference", "tiled", "sdpa", "auto"]
# one registered name per backend ("sdpa" may not appear in a name: transformers would take it
# for torch's SDPA)
NAMES = {
    b: dikkat.hf.register(f"dikkat-test-{b.replace('sdpa', 'fused')}", backend=b) for b in BACKENDS
}
TOL = 1e-5
B, T, V = 3, 12, 97
LENGTHS = [12, 9, 5]  # real tokens per row


def _small(**extra: object) -> dict:
    return dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, **extra)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        scale_attn_by_inverse_layer_idx=True,  # a scaling other than 1/√D reaches attention
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        **_small(num_attention_heads=4), max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        **_small(num_attention_heads=4, num_key_value_heads=2), max_position_embeddings=64
    )
    return transformers.LlamaForCausalLM(config)


def mistral() -> nn.Module:
    config = transformers.MistralConfig(
        **_small(num_attention_heads=4, num_key_value_heads=1), max_position_embeddings=64,
        sliding_window=4,
    )  # fmt: skip
    return transformers.MistralForCausalLM(config)


def gemma2(softcap: float | None = 1.0) -> nn.Module:
    # weights drawn wide (initializer_range) and a small cap, so that the cap bends the scores
    # of a tiny random model (test_gemma2_soft_capping_reaches_the_logits)
    config = transformers.Gemma2Config(
        **_small(num_attention_heads=4, num_key_value_heads=2), head_dim=8,
        max_position_embeddings=64, query_pre_attn_scalar=8, initializer_range=0.5,
        attn_logit_softcapping=softcap,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


def gpt_oss(sinks: bool = True) -> nn.Module:
    # the sinks (one logit per query head, s_aux=) drawn wide, so that they move the weights of
    # a tiny random model (test_gpt_oss_sinks_reach_the_logits); sinks=False: −30, which leaves
    # exp(sink) below fp32's resolution of any row's sum — the model as if it had none
    config = transformers.GptOssConfig(
        **_small(num_attention_heads=4, num_key_value_heads=2), head_dim=8,
        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            if sinks:
                layer.self_attn.sinks.normal_(0.0, 2.0)
            else:
                layer.self_attn.sinks.fill_(-30.0)
    return model


# model, and whether it pads on the left (decoders that generate) or the right
MODELS = {"gpt2": (gpt2, False), "bert": (bert, False), "llama": (llama, True),
          "mistral": (mistral, True), "gemma2": (gemma2, True),
          "gpt_oss": (gpt_oss, True)}  # fmt: skip
DECODERS = ["gpt2", "llama", "mistral", "gemma2", "gpt_oss"]
# (model, backend) pairs the backend cannot serve, and what its refusal says
REFUSED = {
    ("gemma2", "sdpa"): "cannot soft-cap the scores",
    ("gpt_oss", "sdpa"): "cannot add attention sinks (sinks=)",
}


def switch(model: nn.Module, name: str, backend: str, run: Callable[[], object]) -> None:
    """Switch ``model`` to dikkat on ``backend``; where that backend cannot serve the model, check
    that ``run`` (a call of the model) raises its reason, and skip the test with it."""
    model.set_attn_implementation(NAMES[backend])
    refusal = REFUSED.get((name, backend))
    if refusal is None:
        return
    with pytest.raises(ValueError, match=f"backend '{backend}' cannot serve this call") as e:
        run()
    assert refusal in str(e.value)
    pytest.skip(str(e.value))


def make(name: str, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """The model (eval, eager) and a padded batch: ids (B, T), attention_mask (B, T)."""
    build, left = MODELS[name]
    torch.manual_seed(seed)
    model = build().eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(1, V, (B, T))
    real = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]  # right padding
    if left:
        real = real.flip(-1)
    return model, ids.masked_fill(~real, 0), real.long()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_eager(name, backend):
    model, ids, mask = make(name)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        switch(model, name, backend, lambda: model(ids, attention_mask=mask))
        got = model(ids, attention_mask=mask).logits
    # padded positions' outputs are nobody's (a query that sees no key: dikkat gives 0 where
    # eager averages every value)
    real = mask.bool()
    assert real.sum() == sum(LENGTHS)
    assert float((got - want)[real].abs().max()) <= TOL
    assert float(want[real].abs().max()) > 0.01  # not a comparison of two zeros


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generate_with_cache_equals_eager(name, backend, cache):
    """A dynamic cache (a sliding-window model's keeps only the window's last keys, numbered
    from an offset) and a static one (keys up to its length, the rest hidden; its masks
    prepared by generate before the forward)."""
    model, ids, mask = make(name, seed=1)
    config = model.generation_config
    config.pad_token_id = 0
    kwargs = dict(
        attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=True,
        cache_implementation=cache,
    )  # fmt: skip
    want = model.generate(ids, **kwargs)
    switch(model, name, backend, lambda: model.generate(ids, **kwargs))
    got = model.generate(ids, **kwargs)
    assert want.shape == (B, T + 8)
    assert torch.equal(got, want)


def _grads(model: nn.Module, ids: Tensor, mask: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    # the loss reads only real tokens predicted from real tokens: a causal LM predicts token t
    # from position t - 1, and a left-padded row's first real token would be predicted from a
    # padding position, whose output (a query that sees no key) eager and dikkat define apart
    read = mask.bool()
    read[:, 1:] &= read[:, :-1].clone()
    labels = ids.masked_fill(~read, -100)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_equal_eager(name, backend):
    model, ids, mask = make(name, seed=2)
    model.train()  # every dropout is 0: train mode changes nothing but what HF passes
    want = _grads(model, ids, mask)
    switch(model, name, backend, lambda: _grads(model, ids, mask))
    got = _grads(model, ids, mask)
    assert got.keys() == want.keys() and len(want) > 10
    for key in want:
        scale = max(1.0, float(want[key].abs().max()))
        assert float((got[key] - want[key]).abs().max()) <= TOL * scale, key
    assert any(float(g.abs().max()) > 1e-3 for g in want.values())


def test_every_attention_layer_runs_through_dikkat():
    """The tiled backend's plan cache counts its calls: one per layer and forward."""
    from dikkat.core.tiled import plans

    model, ids, mask = make("llama")
    model.set_attn_implementation(NAMES["tiled"])
    registered = transformers.AttentionInterface()[NAMES["tiled"]]
    assert registered is dikkat.hf.attention_function("tiled")
    before = plans.builds + plans.hits
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert plans.builds + plans.hits - before == model.config.num_hidden_layers


def test_register_is_idempotent_and_refuses_sdpa_names():
    again = dikkat.hf.register(NAMES["tiled"], backend="tiled")
    assert transformers.AttentionInterface()[again] is dikkat.hf.attention_function("tiled")
    for name in ("dikkat_sdpa", "flash-dikkat", "eager", "org/kernel"):
        with pytest.raises(ValueError, match="cannot be registered"):
            dikkat.hf.register(name)
    with pytest.raises(ValueError, match="backend must be one of"):
        dikkat.hf.register("dikkat-test-typo", backend="tiledd")


def test_a_causal_model_without_a_mask_function_raises():
    """Registered as an attention function alone, transformers hands the layers no mask: a
    causal model must refuse rather than let every query see the future."""
    transformers.AttentionInterface.register("dikkat-test-nomask", dikkat.hf.attention_function())
    model, ids, mask = make("llama")
    model.set_attn_implementation("dikkat-test-nomask")
    with pytest.raises(ValueError, match="no attention mask for the causal layer"):
        model(ids, attention_mask=mask)


def test_dropout_on_a_backend_without_it_raises():
    model, ids, mask = make("llama")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train().set_attn_implementation(NAMES["tiled"])
    with pytest.raises(ValueError, match="'tiled' cannot serve this call: it has no dropout"):
        model(ids, attention_mask=mask)


def test_gemma2_soft_capping_reaches_the_logits():
    """Without the cap the same weights give other logits: the comparisons above see it."""
    torch.manual_seed(0)
    capped = gemma2().eval()
    torch.manual_seed(0)
    uncapped = gemma2(softcap=None).eval()
    _, ids, mask = make("gemma2")
    capped.set_attn_implementation(NAMES["reference"])
    uncapped.set_attn_implementation(NAMES["reference"])
    with torch.no_grad():
        a = capped(ids, attention_mask=mask).logits
        b = uncapped(ids, attention_mask=mask).logits
    assert float((a - b)[mask.bool()].abs().max()) > 0.1


def test_gpt_oss_sinks_reach_the_logits():
    """The same weights without sinks give other logits, on dikkat as on eager: the comparisons
    above see the sinks (before dikkat took them, s_aux= was refused, and a sinks= keyword
    ignored, which gave eager's logits without sinks)."""
    _, ids, mask = make("gpt_oss")
    logits = {}
    for sinks in (True, False):
        torch.manual_seed(0)
        model = gpt_oss(sinks).eval()
        model.set_attn_implementation(NAMES["tiled"])
        with torch.no_grad():
            logits[sinks] = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        with torch.no_grad():
            eager = model(ids, attention_mask=mask).logits
        real = mask.bool()
        assert float((logits[sinks] - eager)[real].abs().max()) <= TOL
    assert float((logits[True] - logits[False])[mask.bool()].abs().max()) > 0.1


def test_recording_says_which_backend_each_layer_took_and_why():
    """auto's choice per layer, with explain's reasons: Gemma 2's soft-capped calls cannot go to
    sdpa, so every one of its layers says tiled and why; a fixed backend says so."""
    model, ids, mask = make("gemma2")
    model.set_attn_implementation(NAMES["auto"])
    with torch.no_grad(), dikkat.hf.recording() as calls:
        model(ids, attention_mask=mask)
    layers = model.config.num_hidden_layers
    assert [c.layer for c in calls] == [f"Gemma2Attention[{i}]" for i in range(layers)]
    assert all(c.backend == "tiled" for c in calls)
    assert all("not sdpa: it cannot soft-cap the scores" in c.why for c in calls)
    model, ids, mask = make("llama")
    model.set_attn_implementation(NAMES["tiled"])
    with torch.no_grad(), dikkat.hf.recording() as calls:
        model(ids, attention_mask=mask)
    assert len(calls) == model.config.num_hidden_layers
    assert {c.backend for c in calls} == {"tiled"}
    with torch.no_grad():
        model(ids, attention_mask=mask)  # outside the block nothing is kept
    assert len(calls) == model.config.num_hidden_layers
