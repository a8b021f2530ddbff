"""``dikkat.pretrained.load`` on Hugging Face folders: tiny random Llama, Mistral, Qwen2 and
Gemma 3 models saved by transformers give transformers' logits and greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_hf import WINDOW, save_tiny

import dikkat
from dikkat.pretrained.families.llama import unpermute_rope_rows

pytest.importorskip("transformers")

FAMILIES = [
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "smollm3",
    "olmo2",
    "phi3",
    "phi4",
    "gemma2",
    "gemma3",
]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, folder)
    return request.param, hf, dikkat.pretrained.load(folder), folder


def test_logits_equal_transformers_past_the_window(pair):
    _, hf, ours, _ = pair
    ids = torch.randint(2, 300, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.model(ids)
    scale = want.abs().max().item()
    assert scale > 0.1  # random weights give logits of O(1): the comparison is not of zeros
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_the_family_is_built_as_its_config_says(pair):
    family, _, ours, _ = pair
    c = ours.model.config
    assert c.family == {"llama3": "llama", "phi4": "phi3"}.get(family, family)
    assert c.n_layers == (4 if family == "smollm3" else 3)
    ropes = [b.attn.rope is not None for b in ours.model.blocks]
    assert ropes == ([True, True, True, False] if family == "smollm3" else [True] * 3)
    assert c.kv_heads == 2 and (c.rope_factors is not None) == (family in ("llama3", "phi4"))
    assert (c.rotary_dim, c.rope_original_len) == ((4, 20) if family == "phi4" else (None, None))
    sliding = [b.window for b in ours.model.blocks]
    expected = {
        "llama": [None] * 3,
        "llama3": [None] * 3,
        "mistral": [WINDOW] * 3,
        "qwen2": [None, WINDOW, WINDOW],
        "qwen3": [None] * 3,
        "qwen3moe": [None] * 3,
        "smollm3": [None] * 4,
        "olmo2": [None] * 3,
        "gemma2": [WINDOW, None, WINDOW],
        "phi3": [WINDOW] * 3,
        "phi4": [None] * 3,
        "gemma3": [WINDOW, None, WINDOW],
    }[family]
    assert sliding == expected
    experts = [getattr(b.mlp, "n_experts", 0) for b in ours.model.blocks]
    assert experts == ([4] * 3 if family == "qwen3moe" else [0] * c.n_layers)


def test_greedy_generation_equals_transformers(pair):
    _, hf, ours, _ = pair
    prompt = torch.randint(2, 300, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0]
    got = ours.model.generate(prompt, 12)[0]
    assert got == want.tolist()


def test_padded_batch_decodes_each_row_as_alone(pair):
    _, _, ours, _ = pair
    short, long = [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2]
    both = ours.model.generate([short, long], 10)
    assert both[0] == ours.model.generate([short], 10)[0]
    assert both[1] == ours.model.generate([long], 10)[0]


def test_the_text_interface_runs(pair):
    _, _, ours, _ = pair
    out = ours.generate(["hello", "a longer text"], max_new_tokens=4)
    assert isinstance(out, list) and len(out) == 2 and all(isinstance(t, str) for t in out)
    with pytest.raises(ValueError, match="no chat template"):
        ours.chat([{"role": "user", "content": "hi"}])


def test_a_config_with_what_dikkat_lacks_is_refused(tmp_path):
    base = save_tiny("llama", tmp_path).config.to_dict()
    for key, value, word in (
        ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "RoPE scaling 'yarn'"),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "RoPE scaling 'dynamic'"),
        ("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0] * 4}, "longrope"),
        ("mlp_bias", True, "mlp_bias"),
        ("hidden_act", "gelu", "activation"),
        ("model_type", "gpt2", "model_type"),
    ):
        (tmp_path / "config.json").write_text(json.dumps(base | {key: value}))
        with pytest.raises(ValueError, match=word):
            dikkat.pretrained.load(tmp_path)


def test_extra_weights_are_refused_not_dropped(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"not used by dikkat \['model.layers.0.mlp.extra"):
        dikkat.pretrained.load(tmp_path)


def test_gguf_rope_rows_are_put_back():
    # llama.cpp's converter interleaves each head's halves: rows (j, D/2 + j) → (2j, 2j + 1)
    heads, D = 3, 8
    w = torch.arange(heads * D * 2, dtype=torch.float32).view(heads * D, 2)
    permuted = w.view(heads, 2, D // 2, 2).transpose(1, 2).reshape(heads * D, 2)
    assert torch.equal(unpermute_rope_rows(permuted, heads), w)
