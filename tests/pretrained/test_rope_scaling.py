"""RoPE scaling from both forms of a model: a tiny random Llama with Llama 3.1's scaling, saved by
transformers and written as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes it (q/k
rows interleaved, the divisors as a ``rope_freqs`` tensor computed here from the converter's
formula), loads to the same model; and the settings of both formats, read or refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hf_gguf import write_gguf
from tiny_hf import LLAMA3_ROPE, save_tiny

import dikkat
from dikkat.pretrained.families.rope_scaling import (
    gguf_rope_factors,
    hf_rope_factors,
    hf_rope_fields,
)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def converter_rope_freqs(head_dim: int, base: float, p: dict) -> np.ndarray:
    """The ``rope_freqs`` values llama.cpp's converter writes for ``rope_type="llama3"``: per
    frequency, 1 for short waves, ``factor`` for long ones, the blend's inverse between."""
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out, dtype=np.float32)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3")
    hf = save_tiny("llama3", folder)
    return hf, folder


def test_the_gguf_file_is_the_folder_and_transformers(llama3, tmp_path):
    hf, folder = llama3
    freqs = converter_rope_freqs(8, LLAMA3_ROPE["rope_theta"], LLAMA3_ROPE)
    assert sorted(set(freqs.tolist()))[0] == 1.0 and freqs.max() == 4.0  # kept and divided
    path = write_gguf(hf, tmp_path / "llama3.gguf", "llama", rope_freqs=freqs)
    from_file, from_folder = dikkat.pretrained.load(path), dikkat.pretrained.load(folder)
    assert from_file.model.config.rope_factors == pytest.approx(
        from_folder.model.config.rope_factors, rel=1e-7
    )
    ids = torch.randint(2, 300, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits
        got_file, got_folder = from_file.model(ids), from_folder.model(ids)
    torch.testing.assert_close(got_file, got_folder, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_file, want, atol=1e-4, rtol=0)
    unscaled = write_gguf(hf, tmp_path / "unscaled.gguf", "llama")
    with torch.no_grad():  # the scaling is not a no-op on these positions
        off = (dikkat.pretrained.load(unscaled).model(ids) - want).abs().max().item()
    assert off > 50 * (got_file - want).abs().max().item()


def test_llama_3_2_config_json_gives_its_factors():
    """Llama 3.2 1B's config.json as published (the older ``rope_scaling`` layout)."""
    hf = {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    got = hf_rope_factors(hf, 64, "cfg")
    want = converter_rope_freqs(64, 500000.0, hf["rope_scaling"])
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6)
    assert hf_rope_factors({"rope_theta": 1e4}, 64, "cfg") is None
    linear = {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 8.0}}
    assert hf_rope_factors(linear, 8, "cfg") == (8.0,) * 4
    gemma = {  # transformers 5's per-kind layout: the full layers scaled, the sliding not
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    }
    assert hf_rope_factors(gemma, 8, "cfg") == (8.0,) * 4


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            r"llama3 RoPE scaling without \['low",
        ),
        (
            {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 4}},
            r"longrope RoPE scaling without \['short_factor'\]",
        ),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "RoPE scaling of the sliding_attention layers",
        ),
    ],
)
def test_config_json_scaling_dikkat_lacks_is_refused(hf, message):
    with pytest.raises(ValueError, match=message):
        hf_rope_fields(hf, 8, "cfg")


def test_longrope_and_partial_rotary_fields_are_transformers_own():
    """Phi-4-mini's settings: RoPE on 3/4 of each head; LongRoPE's attention factor computed
    from the contexts as transformers computes it, or taken as given."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 2.0, 3.0], "long_factor": [4.0] * 3}
    hf = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
          "partial_rotary_factor": 0.75, "rope_scaling": rope}  # fmt: skip
    fields = hf_rope_fields(hf, 8, "cfg")
    assert fields == {
        "rotary_dim": 6,
        "rope_factors": (1.0, 2.0, 3.0),
        "rope_long_factors": (4.0, 4.0, 4.0),
        "rope_original_len": 4096,
        "rope_mscale": math.sqrt(1 + math.log(32) / math.log(4096)),
    }
    given = hf | {"rope_scaling": rope | {"attention_factor": 1.25}}
    assert hf_rope_fields(given, 8, "cfg")["rope_mscale"] == 1.25


def header(**keys) -> dict:
    return {"general.architecture": "llama"} | {
        f"llama.rope.scaling.{k}": v for k, v in keys.items()
    }


def test_gguf_scaling_settings():
    freqs = torch.tensor([1.0, 2.0, 4.0, 4.0])
    values = {"rope_freqs.weight": freqs}.__getitem__
    shapes = {"rope_freqs.weight": (4,)}
    assert gguf_rope_factors(header(), {}, values, 8, "f") is None
    assert gguf_rope_factors(header(type="none"), {}, values, 8, "f") is None
    assert gguf_rope_factors(header(type="linear", factor=2.0), {}, values, 8, "f") == (2.0,) * 4
    assert gguf_rope_factors(header(), shapes, values, 8, "f") == (1.0, 2.0, 4.0, 4.0)
    both = gguf_rope_factors(header(type="linear", factor=2.0), shapes, values, 8, "f")
    assert both == (2.0, 4.0, 8.0, 8.0)  # llama.cpp multiplies the two
    with pytest.raises(ValueError, match="RoPE scaling 'yarn'"):
        gguf_rope_factors(header(type="yarn"), {}, values, 8, "f")
    with pytest.raises(
        ValueError, match=r"rope_freqs.weight is \(4,\), not one divisor for each of the 8"
    ):
        gguf_rope_factors(header(), shapes, values, 16, "f")
    bad = {"rope_freqs.weight": torch.tensor([1.0, 0.0, 1.0, 1.0])}.__getitem__
    with pytest.raises(ValueError, match=r"f: rope_freqs\.weight: factors must be positive"):
        gguf_rope_factors(header(), shapes, bad, 8, "f")
    with pytest.raises(ValueError, match="is not a factor"):
        gguf_rope_factors(header(type="linear"), {}, values, 8, "f")
