"""Is the attention an explanation? A token's attention beside how much each input token matters.

Notation: ``T`` tokens, ``K`` the input tokens compared, ``C`` width.

Jain & Wallace (2019, "Attention is not Explanation", arXiv:1902.10186) compare attention
weights with feature-importance measures of the same output and find the two often rank the
inputs differently. :func:`text_faithfulness` does that for one focused query token of a text:

- **leave one out**: the change of the output when input token j is hidden — for an encoder
  (BERT, MiniLM) ``1 − cos`` between the focused token's last hidden state with and without
  token j replaced by ``[MASK]`` (removed, for a tokenizer that has none); for a causal model the
  size of the change of the log-probability the focused position gives its next token
  (the text's next token, or the model's own guess at the end) when token j is removed;
- **gradient × input** (causal models): ``|Σ_c ∂ log p / ∂e_jc · e_jc|`` over token j's
  embedding e_j;

and :func:`spearman` ranks them against the focused row's attention (each layer's mean over
heads, and the rollout, :mod:`dikkat.maps.rollout`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.maps.collect import find_token
from dikkat.maps.rollout import rollout
from dikkat.maps.text import TextModel, encode_text, text_maps
from dikkat.viz.maps import AttentionMaps

__all__ = [
    "MAX_TOKENS",
    "Faithfulness",
    "attention_rows",
    "gradient_x_input",
    "rank",
    "spearman",
    "text_faithfulness",
]

MAX_TOKENS = 512  # the check runs one forward per token and needs every layer's T × T weights
CHUNK = 32  # perturbed inputs per forward


def rank(x: Sequence[float] | np.ndarray) -> np.ndarray:
    """Ranks 1 … n of ``x`` (1-D), tied values given the mean of the ranks they share."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"rank takes a 1-D array, got shape {x.shape}")
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    s = x[order]
    start = 0
    while start < len(s):
        end = start
        while end + 1 < len(s) and s[end + 1] == s[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (the Pearson correlation of their ranks,
    ties averaged), over the positions where both are finite; NaN when fewer than two remain or
    one of them is constant there."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(
            f"spearman takes two 1-D arrays of one length, got {a.shape} and {b.shape}"
        )
    keep = np.isfinite(a) & np.isfinite(b)
    if keep.sum() < 2:
        return float("nan")
    ra, rb = rank(a[keep]), rank(b[keep])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


@dataclass(frozen=True)
class Faithfulness:
    """One query's attention beside each input token's importance to one output."""

    focus: str  # the focused query token
    position: int  # its input position
    output: str  # what the importance measures
    tokens: tuple[str, ...]  # the input tokens compared (K)
    positions: tuple[int, ...]  # their input positions
    importance: dict[str, np.ndarray]  # method ("leave-one-out", …) → (K,)
    attention: dict[
        str, np.ndarray
    ]  # where the weights come from ("layer 0 (mean of heads)") → (K,)

    def correlations(self) -> dict[str, dict[str, float]]:
        """attention source → importance method → Spearman ρ."""
        return {
            name: {method: spearman(att, imp) for method, imp in self.importance.items()}
            for name, att in self.attention.items()
        }

    def table(self) -> str:
        """The correlations as a table, with how to read them."""
        methods = list(self.importance)
        width = max(len(name) for name in self.attention) + 2
        lines = [
            f"Spearman rank correlation between the attention of {self.focus!r} (position "
            f"{self.position}) and each token's importance, over {len(self.tokens)} tokens",
            f"importance: {self.output}",
            "attention".ljust(width) + "".join(f"{m:>20}" for m in methods),
        ]
        for name, row in self.correlations().items():
            lines.append(name.ljust(width) + "".join(f"{row[m]:>+20.2f}" for m in methods))
        lines.append(
            "ρ near +1: the weights rank the tokens as their effect does; near 0 or below: "
            "here the attention is not an explanation of the output (docs/show.md)"
        )
        return "\n".join(lines)


def attention_rows(full: AttentionMaps, row: int, keys: Sequence[int]) -> dict[str, np.ndarray]:
    """Query position ``row``'s weights on ``keys`` from maps of every layer, head and row:
    each layer's mean over heads, then the rollout to the last layer."""
    keys = list(keys)
    out = {
        f"{layer} (mean of heads)": full.weights[i, :, row][:, keys].mean(axis=0).astype(np.float64)
        for i, layer in enumerate(full.layers)
    }
    out[f"rollout to {full.layers[-1]}"] = rollout(full.weights)[-1, row, keys]
    return out


def gradient_x_input(embedding: nn.Module, scalar: Callable[[], Tensor]) -> np.ndarray:
    """|Σ_c ∂s/∂e_jc · e_jc| for each position j of the output e (1, K, C) of ``embedding``'s
    first call while ``scalar()`` computes s; the model's parameters get no gradient."""
    seen: list[Tensor] = []

    def hook(module: nn.Module, args: object, out: Tensor) -> Tensor:
        leaf = out.detach().requires_grad_(True)
        seen.append(leaf)
        return leaf

    handle = embedding.register_forward_hook(hook)
    try:
        with torch.enable_grad():
            s = scalar()
            (grad,) = torch.autograd.grad(s, seen[0])
    finally:
        handle.remove()
    return (grad * seen[0]).detach().sum(-1)[0].abs().double().cpu().numpy()


def _batched(
    forward: Callable[[Tensor], Tensor], rows: list[Tensor], pick: Callable[[Tensor], Tensor]
) -> Tensor:
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), CHUNK):
            out.append(pick(forward(torch.stack(rows[start : start + CHUNK]))))
    return torch.cat(out)


def _encoder_importance(tm: TextModel, x: Tensor, focus: int) -> tuple[np.ndarray, str]:
    T = len(x)
    with torch.no_grad():
        h = tm.forward(x[None])[0, focus]
    if tm.mask_id is not None:
        rows = [
            x.clone().index_fill_(0, torch.tensor(j, device=x.device), tm.mask_id) for j in range(T)
        ]
        hidden = _batched(tm.forward, rows, lambda out: out[:, focus])
        how = "replaced by [MASK]"
    else:  # no mask token: remove token j; the focus moves left when j comes before it
        others = [j for j in range(T) if j != focus]
        rows = [torch.cat([x[:j], x[j + 1 :]]) for j in others]
        shifted = torch.tensor([focus - (j < focus) for j in others], device=x.device)
        hidden = torch.full((T, h.shape[-1]), float("nan"), device=x.device, dtype=h.dtype)
        if others:
            got = _batched(tm.forward, rows, lambda out: out)
            hidden[others] = got[torch.arange(len(others)), shifted]
        how = "removed"
    change = 1 - F.cosine_similarity(hidden.double(), h.double()[None], dim=-1)
    return (
        change.cpu().numpy(),
        f"1 − cos of the focused token's last hidden state when the token is {how}",
    )


def _causal_importance(
    tm: TextModel, x: Tensor, focus: int, labels: Sequence[str]
) -> tuple[np.ndarray, str, int]:
    with torch.no_grad():
        logp = tm.forward(x[None])[0, focus].double().log_softmax(-1)
    target = int(x[focus + 1]) if focus + 1 < len(x) else int(logp.argmax())
    importance = np.full(focus + 1, np.nan)
    if focus > 0:
        prefix = x[: focus + 1]
        rows = [torch.cat([prefix[:j], prefix[j + 1 :]]) for j in range(focus + 1)]
        lp = _batched(tm.forward, rows, lambda out: out[:, -1].double().log_softmax(-1)[:, target])
        importance = (logp[target] - lp).abs().cpu().numpy()
    following = labels[focus + 1] if focus + 1 < len(x) else f"id {target} (the model's guess)"
    return (
        importance,
        f"|Δ log p| of the next token ({following!r}) when the token is removed",
        target,
    )


def text_faithfulness(tm: TextModel, text: str, focus: int | str) -> Faithfulness:
    """Attention of the token ``focus`` (a position or a token, :func:`dikkat.maps.find_token`)
    of ``text`` against each input token's leave-one-out importance (and, for a causal model,
    gradient × input) — the keys it can see: all for an encoder, 0 … focus for a causal model."""
    ids, labels = encode_text(tm, text)
    if len(ids) > MAX_TOKENS:
        raise ValueError(
            f"the text has {len(ids)} tokens; the faithfulness check runs a forward per token "
            f"and needs every layer's T × T weights, so it takes at most {MAX_TOKENS}"
        )
    f = find_token(labels, focus)
    full = text_maps(tm, text)
    keys = list(range(f + 1)) if tm.causal else list(range(len(ids)))
    x = torch.tensor(ids, device=tm.device)
    was = tm.module.training
    tm.module.eval()
    try:
        if tm.causal:
            loo, output, target = _causal_importance(tm, x, f, labels)

            def scalar() -> Tensor:
                return tm.forward(x[None, : f + 1])[0, -1].log_softmax(-1)[target]

            importance = {
                "leave-one-out": loo,
                "gradient × input": gradient_x_input(tm.embedding, scalar),
            }
        else:
            loo, output = _encoder_importance(tm, x, f)
            importance = {"leave-one-out": loo}
    finally:
        tm.module.train(was)
    return Faithfulness(
        focus=labels[f],
        position=f,
        output=output,
        tokens=tuple(labels[j] for j in keys),
        positions=tuple(keys),
        importance=importance,
        attention=attention_rows(full, f, keys),
    )
