"""Attention weights of Hugging Face models run through dikkat: ``output_attentions=True`` and
``dikkat.capture`` give eager's weights (docs/hf.md, "Attention weights").

Notation: ``B`` batch, ``H`` heads, ``T`` tokens, ``L`` layers.

The oracle is transformers' ``attn_implementation="eager"``, which materialises every layer's
softmax; dikkat's backends never hold it and recompute it from q, k and the log-sum-exp. Query
rows of padding tokens are left out of the comparison: such a row sees no key, and eager gives it
uniform weights where dikkat gives zeros.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_attention import BACKENDS, LENGTHS, MODELS, NAMES, make, switch
from torch import Tensor

import dikkat

transformers = pytest.importorskip("transformers")

TOL = 1e-6


def _real_rows(w: Tensor, mask: Tensor) -> Tensor:
    """The weights (B, H, T, S) of the query rows of real tokens, flattened."""
    return w.transpose(1, 2)[mask.bool()]  # (real tokens, H, S)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["bert", "llama", "mistral", "gemma2", "gpt_oss"])
def test_output_attentions_equal_eager(name: str, backend: str) -> None:
    model, ids, mask = make(name)
    with torch.no_grad():
        want = model(ids, attention_mask=mask, output_attentions=True).attentions
        switch(model, name, backend, lambda: model(ids, attention_mask=mask))
        got = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(want) == model.config.num_hidden_layers
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert float((_real_rows(g, mask) - _real_rows(w, mask)).abs().max()) <= TOL
    # a model that masks something: the comparison sees zeros and non-zeros
    assert float(_real_rows(want[-1], mask).max()) > 0.1


def test_gpt2_gives_its_weights_through_capture() -> None:
    """GPT-2 in transformers 5 does not pass output_attentions to the attention function, so
    through any registered attention its ``attentions`` stay empty; capture still sees them."""
    model, ids, mask = make("gpt2")
    with torch.no_grad():
        want = model(ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation(NAMES["auto"])
        assert model(ids, attention_mask=mask, output_attentions=True).attentions == ()
        with dikkat.capture(model) as cap:
            model(ids, attention_mask=mask)
    assert len(cap.layers) == len(want) == 2
    for layer, w in enumerate(want):
        diff = _real_rows(cap[layer], mask) - _real_rows(w, mask)
        assert float(diff.abs().max()) <= TOL


@pytest.mark.parametrize("backend", ["tiled", "sdpa"])
def test_capture_keeps_only_the_selected_layer_heads_and_rows(backend: str) -> None:
    model, ids, mask = make("llama")
    with torch.no_grad():
        want = model(ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation(NAMES[backend])
        with dikkat.capture(model, layers=[-1], heads=[3, 1], rows=[-1, -3]) as cap:
            model(ids, attention_mask=mask)
    names = [name for name, _ in dikkat.attention_layers(model)]
    assert names == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert cap.layers == (names[-1],) and len(cap.calls) == 1
    assert cap[-1].shape == (len(LENGTHS), 2, 2, ids.shape[1])
    # left padding: the last three tokens are real in every row
    torch.testing.assert_close(cap[-1], want[-1][:, [3, 1]][:, :, [-1, -3]], atol=TOL, rtol=0)


def test_capture_counts_gpt_oss_sinks() -> None:
    """gpt-oss's weights leave each row's share of the sink out, as eager's do (each row sums to
    less than 1): tiled's lse counts the sinks, and capture recomputes the weights from it."""
    model, ids, mask = make("gpt_oss")
    with torch.no_grad():
        want = model(ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation(NAMES["tiled"])
        with dikkat.capture(model) as cap:
            model(ids, attention_mask=mask)
    assert len(cap.layers) == len(want) == 2
    for layer, w in enumerate(want):
        diff = _real_rows(cap[layer], mask) - _real_rows(w, mask)
        assert float(diff.abs().max()) <= TOL
    assert float(_real_rows(want[-1], mask).sum(-1).min()) < 0.9  # the sinks took weight


def test_capture_during_generate_follows_the_cache() -> None:
    model, ids, mask = make("mistral", seed=1)
    model.generation_config.pad_token_id = 0
    model.set_attn_implementation(NAMES["auto"])
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    with dikkat.capture(model, layers=[0], heads=[0], rows=[-1]) as cap:
        out = model.generate(ids, **kwargs)
    steps = cap.of(0)
    assert len(steps) == 3
    # the sliding-window cache of Mistral keeps the window's keys only after the prompt
    assert all(w.shape[:3] == (len(LENGTHS), 1, 1) for w in steps)
    rows_sum = torch.stack([w.sum(-1) for w in steps])
    torch.testing.assert_close(rows_sum, torch.ones_like(rows_sum), atol=1e-5, rtol=0)
    assert out.shape[1] == ids.shape[1] + 3


def test_capture_of_a_model_on_eager_attention_says_what_to_do() -> None:
    model, ids, mask = make("llama")
    with (
        pytest.raises(ValueError, match=r"attn_implementation='eager'.*dikkat.hf.register"),
        torch.no_grad(),
        dikkat.capture(model, layers=[0]),
    ):
        model(ids, attention_mask=mask)


def test_every_architecture_has_attention_layers_capture_finds() -> None:
    for name in MODELS:
        model, _, _ = make(name)
        layers = dikkat.attention_layers(model)
        assert len(layers) == model.config.num_hidden_layers, name


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_weights_equal_eager(name: str) -> None:
    """The encoder's, the decoder's and the cross-attention weights; with right padding every
    query row sees some real key, so every row is compared."""
    from test_hf_encoder_decoder import NAMES as ED_NAMES
    from test_hf_encoder_decoder import make as make_ed

    model, batch = make_ed(name)
    kinds = ("encoder_attentions", "decoder_attentions", "cross_attentions")
    with torch.no_grad():
        want = model(**batch, output_attentions=True)
        model.set_attn_implementation(ED_NAMES["tiled"])
        got = model(**batch, output_attentions=True)
        with dikkat.capture(model) as cap:
            model(**batch)
    for kind in kinds:
        assert len(got[kind]) == len(want[kind]) == 2, kind
        for g, w in zip(got[kind], want[kind], strict=True):
            torch.testing.assert_close(g, w, atol=TOL, rtol=0)
    # capture sees the same matrices; its layers in module order: the encoder's, then each
    # decoder layer's own attention and its cross-attention
    enc, dec, cross = (want[kind] for kind in kinds)
    in_module_order = [enc[0], enc[1], dec[0], cross[0], dec[1], cross[1]]
    assert len(cap.layers) == 6
    for layer, w in enumerate(in_module_order):
        torch.testing.assert_close(cap[layer], w, atol=TOL, rtol=0)
