"""``dikkat seeds``: every number of docs/contract.md, computed on real tensors."""

from __future__ import annotations

import argparse
import math
from typing import Any

from dikkat.cli.args import positive_int
from dikkat.cli.common import add_command
from dikkat.seeds import (
    SEED_CLAIMS,
    causal_exercise,
    scaling_experiment,
    torch_mha_facts,
    worked_example,
)


def _fmt(values, digits: int = 2) -> str:
    return "(" + ", ".join(f"{float(x):.{digits}f}" for x in values) + ")"


def cmd_seeds(args: argparse.Namespace) -> int:
    """Print each number we compute beside the number docs/contract.md states."""

    def row(label: str, ours: str, stated: str) -> None:
        print(f"  {label:<28} {ours:<34} stated: {stated}")

    print("dikkat seeds — the numbers of docs/contract.md, computed\n")
    print("§2  worked example, d_k = 2 (softmax(QKᵀ/√2)V, reference backend, float64)")
    ex = worked_example()
    row("A's scores (A←A, A←B)", _fmt(ex.scores[0], 3), SEED_CLAIMS["§2 A scores"])
    row("A's weights", _fmt(ex.weights[0]), SEED_CLAIMS["§2 A weights"])
    row("o_A", _fmt(ex.outputs[0]), SEED_CLAIMS["§2 o_A"])
    row("B's scores (B←A, B←B)", _fmt(ex.scores[1], 3), SEED_CLAIMS["§2 B scores"])
    row("B's weights", _fmt(ex.weights[1]), SEED_CLAIMS["§2 B weights"])
    row("o_B", _fmt(ex.outputs[1]), "closer to B's value [0, 1]")

    print("\n§4  causal mask, 3 tokens: cells set to −∞ (x) — queries down, keys across")
    for i, r in enumerate(causal_exercise(3).tolist()):
        print(
            "  "
            + " ".join("x" if c else "." for c in r)
            + ("   " + SEED_CLAIMS["§4"] if i == 0 else "")
        )

    s = scaling_experiment(d_k=args.d_k)
    print(f"\n§3  why divide by √d_k: d_k = {s.d_k}, {s.n_keys} keys, unit-variance q and k")
    row(
        "score variance",
        f"unscaled {s.score_var_unscaled:.1f}, scaled {s.score_var_scaled:.2f}",
        f"grows with d_k ({s.d_k}) vs ≈ 1",
    )
    row(
        "mean largest weight",
        f"unscaled {s.max_weight_unscaled:.2f}, scaled {s.max_weight_scaled:.2f}",
        SEED_CLAIMS["§3"],
    )
    row(
        "mean entropy (nats)",
        f"unscaled {s.entropy_unscaled:.2f}, scaled {s.entropy_scaled:.2f}",
        f"uniform would be {math.log(s.n_keys):.2f}",
    )

    print("\n§13 torch.nn.MultiheadAttention script, run through MultiHeadAttention.from_torch")
    f = torch_mha_facts()
    row("weights shape", str(f.weights_shape), SEED_CLAIMS["§13 shape"])
    row("same outputs after shuffling", str(f.shuffle_equal), SEED_CLAIMS["§13 shuffle"])
    row("max |ours − torch| output", f"{f.max_output_diff:.1e}", "(ours must match torch)")
    print(
        f"  causal weights (ours; max |ours − torch| = "
        f"{(f.causal_weights_ours - f.causal_weights_torch).abs().max().item():.1e}):"
    )
    for r in f.causal_weights_ours.tolist():
        print("    " + " ".join(f"{x:.2f}" for x in r))
    print(f"  {'':<28} {'':<34} stated: {SEED_CLAIMS['§13 causal']}")
    return 0


def add_commands(sub: Any) -> None:
    p = add_command(
        sub,
        "seeds",
        cmd_seeds,
        help="the numbers of docs/contract.md, computed on real tensors",
        description="Walk through the examples of docs/contract.md on real tensors: the worked "
        "example, the causal mask, √d_k scaling and the nn.MultiheadAttention facts, each "
        "beside the number the contract states.",
        examples=[("dikkat seeds", "every number, computed"), ("dikkat seeds --d-k 128", "")],
    )
    p.add_argument("--d-k", type=positive_int, default=64, help="head dim for the scaling demo")
