"""The Llama-family / Gemma 3 Decoder on its own: cached decoding equals the full forward (on
sliding layers too, past the window), the config refuses what cannot be built, save/load."""

from __future__ import annotations

import pytest
import torch

from dikkat import masks
from dikkat.layers import GatedMLP, RMSNorm
from dikkat.models import Decoder, DecoderConfig
from dikkat.models.decoder import gemma3_layer_kinds

GEMMA_LIKE = DecoderConfig(
    family="gemma3", vocab_size=97, max_len=64, d_model=32, n_layers=6, n_heads=4, n_kv_heads=1,
    head_dim=16, d_ff=48, activation="gelu_tanh", rope_base=1e6, local_rope_base=1e4,
    sliding_window=5, layer_kinds=gemma3_layer_kinds(6), qk_norm=True, sandwich_norm=True,
    embed_scale=True, attn_scale=0.25,
)  # fmt: skip
LLAMA_LIKE = DecoderConfig(vocab_size=97, max_len=64, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, d_ff=48, qkv_bias=True)  # fmt: skip


def model_of(config: DecoderConfig) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(config).double().eval()
    with torch.no_grad():  # norms start at 1: vary them so that they matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("config", [GEMMA_LIKE, LLAMA_LIKE], ids=["gemma3", "llama"])
def test_cached_decoding_equals_the_full_forward(config):
    model = model_of(config)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 20)
        steps = [model(ids[:, :7], cache=cache)]  # a prefill longer than the window of 5
        for t in range(7, 20):
            steps.append(model(ids[:, t : t + 1], offset=t, cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)


def test_a_sliding_layer_sees_exactly_its_window():
    model = model_of(GEMMA_LIKE)
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = model(ids)
        changed = ids.clone()
        changed[0, 0] = (ids[0, 0] + 1) % 97
        moved = (model(changed) - base).abs().amax(-1)[0]  # (T,)
    # the full layer (layer 6 of 6) still carries token 0 everywhere: every position moves
    assert bool((moved > 0).all())
    # with only sliding layers the change reaches no further than the stacked windows
    sliding_only = DecoderConfig(**{**GEMMA_LIKE.__dict__, "layer_kinds": ("sliding",) * 6})
    model = model_of(sliding_only)
    with torch.no_grad():
        moved = (model(changed) - model(ids)).abs().amax(-1)[0]
    reach = 6 * (5 - 1)  # each layer looks 4 keys back
    assert bool((moved[: reach + 1] > 0).all()) and bool((moved[reach + 1 :] == 0).all())


def test_the_sliding_mask_is_the_window_of_the_given_mask():
    # a layer's mask is the caller's & sliding_window(w): a padding mask stays in force
    model = model_of(GEMMA_LIKE)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :3] = False  # row 0 left-padded by 3
    with torch.no_grad():
        padded = model(ids, valid=valid)[0, 3:]
        alone = model(ids[:1, 3:])[0]
    torch.testing.assert_close(padded, alone, atol=1e-10, rtol=0)
    m = masks.causal() & masks.sliding_window(5)
    assert m.materialize(1, 1, 9, 9)[0, 0, 8].tolist() == [False] * 4 + [True] * 5


def test_save_and_load_give_the_same_model(tmp_path):
    model = model_of(GEMMA_LIKE).float()
    model.save(tmp_path / "m")
    again = Decoder.load(tmp_path / "m")
    assert again.config == GEMMA_LIKE
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), atol=0, rtol=0)
    assert again.lm_head.weight is again.tok_emb.weight  # still tied


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"n_kv_heads": 3}, "does not divide"),
        ({"head_dim": 15}, "must be even"),
        ({"layer_kinds": ("sliding", "full")}, "each of the 6 layers"),
        ({"sliding_window": None}, "sliding_window is None"),
        ({"activation": "relu"}, "activation"),
        ({"family": "gpt2"}, "family"),
    ],
)
def test_a_config_that_cannot_be_built_is_refused(change, words):
    with pytest.raises(ValueError, match=words):
        DecoderConfig(**{**GEMMA_LIKE.__dict__, **change})


def test_rmsnorm_and_the_gated_mlp_are_their_formulas():
    torch.manual_seed(4)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    norm = RMSNorm(8, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), want, atol=1e-12, rtol=0)
    mlp = GatedMLP(8, 12, activation="silu").double()
    g, u = x @ mlp.gate.weight.T, x @ mlp.up.weight.T
    want = (g * torch.sigmoid(g) * u) @ mlp.down.weight.T
    torch.testing.assert_close(mlp(x), want, atol=1e-12, rtol=0)
