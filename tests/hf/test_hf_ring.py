"""dikkat.hf.register_ring: a Hugging Face model's sequence split over 2 CPU processes (gloo)
gives, gathered, the logits of the model's eager forward on the whole sequence in one process,
and gradients that, summed over the ranks, are the one process's; what the ring cannot compute
is refused on every rank (tests/hf/hf_ring_cases.py runs the cases in each process;
docs/distributed.md, "Hugging Face models")."""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp

import dikkat.hf

pytest.importorskip("transformers")

TIMEOUT_S = 180  # a hung ring fails the test instead of hanging it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ring_models_match_one_process_and_refuse_what_they_cannot_do():
    from hf_ring_cases import run  # imports transformers, which the importorskip above checks

    context = mp.spawn(run, args=(2, free_port()), nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):  # raises as soon as a child fails
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"the ring models did not finish in {TIMEOUT_S} s")


def test_register_ring_checks_its_arguments():
    with pytest.raises(ValueError, match="layout must be one of"):
        dikkat.hf.register_ring("dikkat_ring_test", layout="stripes")
    with pytest.raises(ValueError, match="'sdpa'"):
        dikkat.hf.register_ring("ring_sdpa")
    with pytest.raises(TypeError, match="non-empty str"):
        dikkat.hf.register_ring("")
    assert dikkat.hf.register_ring("dikkat_ring_test", layout="contiguous") == "dikkat_ring_test"
