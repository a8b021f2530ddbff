"""The sampling settings a model's files suggest (dikkat.pretrained.sampling_defaults): a GGUF
header's general.sampling.* keys and a folder's generation_config.json, as SamplingParams
keywords; a value that is no setting is left out with a warning."""

from __future__ import annotations

import json

import pytest
import tiny_gguf as tg

import dikkat
from dikkat.pretrained.sampling_defaults import from_hf_folder

pytest.importorskip("gguf")


def suggesting_file(path, **keys: object) -> None:
    header = {
        f"general.sampling.{k}": tg.Key(
            f"general.sampling.{k}", tg.U32 if isinstance(v, int) else tg.F32, v
        )
        for k, v in keys.items()
    }
    tg.tiny_llama_file(path, header=header)


def test_a_gguf_header_s_sampling_keys_are_the_model_s_defaults(tmp_path):
    path = tmp_path / "suggests.gguf"
    suggesting_file(path, temp=0.5, top_k=40, top_p=0.75, penalty_repeat=1.5, min_p=0.1)
    lm = dikkat.pretrained.load(path)
    assert lm.sampling_defaults == {
        "temperature": 0.5,
        "top_k": 40,
        "top_p": 0.75,
        "repetition_penalty": 1.5,
    }  # fmt: skip (min_p is not a setting dikkat has)
    lm.sampling_defaults = {"repetition_penalty": 1.5}  # greedy, to compare tokens
    assert lm.generate("the quick", 10) == lm.generate("the quick", 10, repetition_penalty=1.5)
    assert lm.generate("the quick", 10) != lm.generate("the quick", 10, repetition_penalty=1.0)


def test_a_value_that_is_no_setting_is_left_out_with_a_warning(tmp_path):
    path = tmp_path / "odd.gguf"
    suggesting_file(path, temp=-1.0, top_p=0.5)
    with pytest.warns(UserWarning, match="general.sampling.temp = -1.0 is not a sampling"):
        lm = dikkat.pretrained.load(path)
    assert lm.sampling_defaults == {"top_p": 0.5}


def test_generation_config_json_sampling_only_where_it_samples(tmp_path):
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
              "repetition_penalty": 1.05, "max_new_tokens": 99}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert from_hf_folder(tmp_path) == {
        "temperature": 0.7, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.05,
    }  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(config | {"do_sample": False}))
    assert from_hf_folder(tmp_path) == {"repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.warns(UserWarning, match="not readable JSON"):
        assert from_hf_folder(tmp_path) == {}
    (tmp_path / "generation_config.json").unlink()
    assert from_hf_folder(tmp_path) == {}
