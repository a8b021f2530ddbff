"""Each Llama-shaped family with a GGUF architecture, from both of its forms: a tiny random
Hugging Face model saved by transformers, and the same model written as llama.cpp's converter
writes it (``hf_gguf.py``), load to the same model — its logits the folder's and transformers'
— and ``dikkat chat FILE -m`` answers from the file as the library does. (Llama with Llama 3's
RoPE scaling: ``test_rope_scaling.py``.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_gguf import write_gguf
from tiny_hf import save_tiny

import dikkat
from helpers import run_cli

pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


# what a GGUF file does not carry, left out of the folder too: Qwen2's window (llama.cpp's qwen2
# has none; the folder's own test covers it)
WITHOUT = {"qwen2": {"use_sliding_window": False, "layer_types": ["full_attention"] * 3}}
ARCHITECTURES = {"phi4": "phi3"}  # a tiny model's family → its GGUF architecture


@pytest.fixture(
    scope="module",
    params=["llama", "qwen2", "qwen3", "qwen3moe", "smollm3", "olmo2", "phi3", "phi4", "gemma2"],
)
def both(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, folder, **WITHOUT.get(request.param, {}))
    arch = ARCHITECTURES.get(request.param, request.param)
    path = write_gguf(hf, folder / "model.gguf", arch, chat_template=TEMPLATE)
    return request.param, hf, folder, path


def test_the_file_is_the_folder_and_transformers(both):
    family, hf, folder, path = both
    from_file, from_folder = dikkat.pretrained.load(path), dikkat.pretrained.load(folder)
    arch = ARCHITECTURES.get(family, family)
    assert from_file.model.config.family == from_folder.model.config.family == arch
    ids = torch.randint(2, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids).logits
        got_file, got_folder = from_file.model(ids), from_folder.model(ids)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got_file, got_folder, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_file, want, atol=1e-4, rtol=0)


def test_chat_answers_from_the_file(both, capsys):
    _, _, _, path = both
    code, out, err = run_cli(["chat", str(path), "-m", "hello", "-n", "5"], capsys)
    assert code == 0, err
    lm = dikkat.pretrained.load(path)
    assert out == lm.chat([{"role": "user", "content": "hello"}], 5, repetition_penalty=1.1) + "\n"


def test_what_a_phi_3_file_holds_that_dikkat_lacks_is_refused(tmp_path):
    hf = save_tiny("phi3", tmp_path / "phi3")
    factors = np.ones(4, dtype=np.float32)
    for options, message in (
        (
            {"extra": {"rope_factors_long.weight": factors}},
            r"LongRoPE needs rope_factors_short.weight of 4 divisors",
        ),
        ({"sizes": {"rope.dimension_count": 10}}, r"rotary_dim must be even and at most"),
    ):
        path = write_gguf(hf, tmp_path / "refused.gguf", "phi3", **options)
        with pytest.raises(ValueError, match=message):
            dikkat.pretrained.load(path)
        path.unlink()


def test_olmo_3_s_sliding_layers_are_refused_in_both_forms(tmp_path):
    hf = save_tiny("olmo2", tmp_path / "olmo2")
    path = write_gguf(hf, tmp_path / "olmo3.gguf", "olmo2", sizes={"attention.sliding_window": 4})
    with pytest.raises(ValueError, match="OLMo 3's sliding layers are not implemented"):
        dikkat.pretrained.load(path)
    config = json.loads((tmp_path / "olmo2" / "config.json").read_text())
    (tmp_path / "olmo2" / "config.json").write_text(json.dumps(config | {"model_type": "olmo3"}))
    with pytest.raises(ValueError, match="OLMo 3's sliding layers are not implemented"):
        dikkat.pretrained.load(tmp_path / "olmo2")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_a_mixture_s_quantised_experts_stay_packed_and_stacked(tmp_path, kind):
    """Experts a file quantised are held as its stacks (one product per stack for all of a
    step's tokens), each expert's layers views of them: the logits the dequantised model's,
    within the activations' rounding; a step reads k of E experts' bytes."""
    from dikkat.bench.bandwidth import weight_bytes
    from dikkat.weights.packed_layers import PackedExperts

    hf = save_tiny("qwen3moe", tmp_path / "hf", hidden_size=64, moe_intermediate_size=32)
    path = write_gguf(hf, tmp_path / "moe.gguf", "qwen3moe", kinds={"_exps": kind})
    packed, expanded = dikkat.pretrained.load(path), dikkat.pretrained.load(path, weights="fp32")
    moe = packed.model.blocks[0].mlp
    assert isinstance(moe.stacked, PackedExperts) and moe.stacked.gate_up is not None
    view = moe.experts[1].down.parts[0].values
    assert view.untyped_storage().data_ptr() == moe.stacked.down.values.untyped_storage().data_ptr()
    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = packed.model(ids), expanded.model(ids)
        one = packed.model(ids[:1, :1])
    torch.testing.assert_close(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)
    torch.testing.assert_close(one[0, 0], got[0, 0], atol=1e-5, rtol=0)
    experts = sum(e.nbytes for e in moe.experts.modules() if hasattr(e, "parts"))
    assert experts == moe.stacked.nbytes  # the views are the stacks, nothing more
    per_expert = sum(e.nbytes for e in moe.experts[0].modules() if hasattr(e, "parts"))
    unpacked = 4 * 3 * 64 * 32  # an expert's three fp32 matrices
    read = weight_bytes(expanded.model) - weight_bytes(packed.model)
    assert read == 3 * 2 * (unpacked - per_expert)  # 3 layers, 2 experts a token
