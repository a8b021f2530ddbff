"""dikkat.hf.register_ring: a Hugging Face model's sequence split over 2 CPU processes (gloo)
gives, gathered, the logits of the model's eager forward on the whole sequence in one process,
and gradients that, summed over the ranks, are the one process's; what the ring cannot compute
is refused on every rank (tests/hf/hf_ring_cases.py runs the cases in each process;
docs/distributed.md, "Hugging Face models")."""

from __future__ import annotations

import pytest

import dikkat.hf
from spawning import spawn

pytest.importorskip("transformers")


def test_ring_models_match_one_process_and_refuse_what_they_cannot_do():
    from hf_ring_cases import run  # imports transformers, which the importorskip above checks

    spawn(run, 2, "the ring models", timeout_s=180)


def test_register_ring_checks_its_arguments():
    with pytest.raises(ValueError, match="layout must be one of"):
        dikkat.hf.register_ring("dikkat_ring_test", layout="stripes")
    with pytest.raises(ValueError, match="'sdpa'"):
        dikkat.hf.register_ring("ring_sdpa")
    with pytest.raises(TypeError, match="non-empty str"):
        dikkat.hf.register_ring("")
    assert dikkat.hf.register_ring("dikkat_ring_test", layout="contiguous") == "dikkat_ring_test"
