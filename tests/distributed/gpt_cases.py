"""What each spawned rank of tests/distributed/test_sequence_parallel.py runs: a GPT trained with
its sequence split over the ranks (dikkat.distributed.SequenceParallel) against the same GPT
trained in this process on whole sequences, in fp64, step by step. An assertion raises in the
child, which fails the test."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ring_cases import expect_value_error

from dikkat.distributed import SequenceParallel, ring_attention
from dikkat.layers import MultiHeadAttention
from dikkat.models import GPT, GPTConfig
from spawning import gloo_group

B, N, V = 2, 23, 40  # N: a length neither 2·2 nor 2·4 chunks divide
STEPS = 3
TOL = 1e-10


def model_pair(position: str, dropout: float = 0.0) -> tuple[GPT, GPT]:
    config = GPTConfig(
        vocab_size=V, max_len=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
        position=position, dropout=dropout,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    whole = GPT(config).double()
    return whole, copy.deepcopy(whole)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (B, N + 1), generator=g) for _ in range(STEPS)]


def check_training(sp: SequenceParallel, position: str) -> None:
    whole, split = model_pair(position)
    opt_whole = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    opt_split = torch.optim.AdamW(split.parameters(), lr=1e-2)
    where = f"{position}, {sp.layout}, rank {sp.rank}"
    for step, seq in enumerate(batches()):
        ids, targets = seq[:, :-1], seq[:, 1:]
        logits = whole(ids)  # (B, N, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt_whole.step()
        opt_whole.zero_grad()

        with sp.attend(split):
            local = split(sp.shard(ids), positions=sp.positions(N))  # (B, T, V)
            # each rank's sum over its tokens, over the count of all: the ranks' losses add up
            # to the mean, and so do their gradients
            part = (
                F.cross_entropy(local.flatten(0, 1), sp.shard(targets).flatten(), reduction="sum")
                / targets.numel()
            )
            part.backward()
        sp.sum_gradients(split)
        opt_split.step()
        opt_split.zero_grad()
        total = part.detach().clone()
        dist.all_reduce(total)
        assert abs(total.item() - loss.item()) < TOL, (step, total.item(), loss.item(), where)
        if step == 0:
            torch.testing.assert_close(
                sp.gather(local.detach()), logits.detach(), rtol=TOL, atol=TOL, msg=where
            )
    assert all(m.backend == "auto" for m in split.modules() if isinstance(m, MultiHeadAttention))
    for (name, p), q in zip(whole.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=TOL, atol=TOL, msg=f"{name}: {where}")
    moved = max((p - q).abs().max().item() for p, q in zip(
        model_pair(position)[0].parameters(), whole.parameters(), strict=True))  # fmt: skip
    assert moved > 1e-3, "training changed nothing: the comparison would be trivially true"


def check_refusals(sp: SequenceParallel, rank: int, world: int) -> None:
    dropping, _ = model_pair("rope", dropout=0.1)
    ids = sp.shard(torch.zeros(1, N, dtype=torch.long))
    with sp.attend(dropping):
        expect_value_error(lambda: dropping(ids, positions=sp.positions(N)), "ring", "dropout")
    expect_value_error(lambda: sp.attend(torch.nn.Linear(2, 2)).__enter__(), "MultiHeadAttention")
    expect_value_error(lambda: sp.positions(0), "length")
    q = torch.zeros(1, 2, ids.shape[1], 4)
    bad = q.clone()
    bad[0, 0, 0, 0] = float("inf") if rank == 0 else 0.0
    expect_value_error(lambda: ring_attention(bad, q, q), "NaN or ±inf", "[0]")


def run(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port):
        for layout in ("zigzag", "contiguous"):
            sp = SequenceParallel(layout=layout, backend_name=f"ring-{layout}")
            for position in ("rope", "learned"):
                check_training(sp, position)
        check_refusals(sp, rank, world)
