"""The two probes of a mask audit: every key set to many token values, and the gradients through
the token embedding — each judged per output against that output's own dependence on the tokens
its mask shows it (docs/audit.md).

Notation: ``B`` batch, ``T`` positions, ``F`` output features per position (flattened), ``C``
embedding width, ``N`` token values each key takes in a trial; a pair ``(i, j)`` is (query
position i whose output is watched, key position j whose token changes).

The tolerance is relative per output: output (i, f) — position i, feature f — counts as reading
key j when changing token j moves it by more than ``rtol`` × S[i, f], where S[i, f] is the most
the same output moved when a token its mask shows it changed (its own included). An output
tiny beside a huge one, or one that barely depends on anything, is held to its own scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dikkat.audit.probe import RTOL, Model, outputs


@dataclass(frozen=True)
class Sweep:
    """What the value sweep found.

    ``read`` (B, T, T) bool: output i of row b moved with token j beyond the tolerance.
    ``scale`` (T, F): S, each output's largest move when a token its mask shows it changed.
    """

    read: Tensor
    scale: Tensor
    rtol: float
    calls: int
    rows: int  # rows of the largest call
    values: int  # token values each key took in each trial


SMALL_VOCAB = 256  # by default every id of a vocabulary up to this size (bytes) is tried …
SAMPLED = 16  # … and of a larger one this many, drawn afresh for each key and trial
MOVED_BYTES = 4 * 2**30  # most the sweep's record of moves may take
STACK_ELEMENTS = 2**24  # most output elements one stacked call may hold (128 MiB in float64)
STACK_LEAST = 4  # fewer values a call than this, and the unchanged rows cost more than they save
STACK_ERRORS = (RuntimeError, ValueError, IndexError, TypeError)  # a batch fn cannot take


def value_count(vocab_size: int, values: int | None) -> int:
    """N, the token ids each key takes in a trial (see :func:`dikkat.audit.mask`'s ``values``)."""
    if values is None:
        return vocab_size if vocab_size <= SMALL_VOCAB else SAMPLED
    return min(values, vocab_size)


def random_ids(vocab_size: int, B: int, T: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, vocab_size, (B, T), generator=gen)


def value_sweep(
    fn: Model,
    vocab_size: int,
    B: int,
    T: int,
    trials: int,
    values: int | None,
    visible: Tensor,
    gen: torch.Generator,
    rtol: float | None,
    device: torch.device,
) -> Sweep:
    """In each of ``trials`` random batches, set each key j to each of N token values in turn
    (in every row at once) and record how far every output moved.

    N is every id when ``vocab_size`` is at most ``values`` (None: :data:`SMALL_VOCAB`), else
    ``values`` ids (None: :data:`SAMPLED`) drawn afresh for each key and trial. ``visible``
    (B, T, T) bool says which keys each output may read (the mask's reach); ``rtol`` None takes
    :data:`RTOL` of the outputs' dtype.

    When ``fn`` takes more rows than B — and gives every copy of a row the same outputs, bit
    for bit — one call holds the unchanged rows and several values' rows, each compared with
    the unchanged rows of its own call; else each call is one value's B rows.
    """
    N = value_count(vocab_size, values)
    moved: Tensor | None = None  # (T_key, B, T, F): max |Δ output| when key j changed
    drift: Tensor | None = None  # (B, T, F): max |Δ output| between two identical calls
    calls, rows, stack = 0, B, 0
    with torch.no_grad():
        for _ in range(trials):
            ids = random_ids(vocab_size, B, T, gen)
            base = outputs(fn, ids.to(device))  # (B, T, F)
            again = (outputs(fn, ids.to(device)) - base).abs()
            calls += 2
            if moved is None:
                check_memory(base, T)
                rtol = RTOL.get(base.dtype, 1e-2) if rtol is None else rtol
                moved, drift = base.new_zeros((T, *base.shape)), torch.zeros_like(base)
                stack = stack_size(fn, ids, base, N, device)
                calls += int(stack > 0)
            check_repeatable(again, rtol * float(base.abs().max()), "the largest |output|")
            drift = torch.maximum(drift, again)
            for j in range(T):
                every = vocab_size == N  # else a fresh draw for this key and trial
                chosen = torch.arange(N) if every else torch.randperm(vocab_size, generator=gen)
                for chunk in chunks(chosen[:N].tolist(), max(stack, 1)):
                    delta = moves(fn, ids, base, j, chunk, stack > 0, device)  # (B, T, F)
                    moved[j] = torch.maximum(moved[j], delta)
                    calls += 1
                    rows = max(rows, (len(chunk) + int(stack > 0)) * B)
    assert moved is not None and drift is not None and rtol is not None  # trials ≥ 1
    scale = dependence_scale(moved, visible)
    tol = rtol * scale  # (T, F)
    noisy = drift > tol
    if bool(noisy.any()):
        b, i, f = (int(x) for x in noisy.nonzero()[0])
        what = f"{rtol:g} × how much output {f} at position {i} depends on what it may see"
        check_repeatable(drift[b, i, f], float(tol[i, f]), what)
    read = torch.stack([(moved[j] > tol).any(-1) for j in range(T)], dim=-1)  # (B, T, T)
    return Sweep(read.cpu(), scale, rtol, calls, rows, N)


def moves(
    fn: Model,
    ids: Tensor,
    base: Tensor,
    j: int,
    chunk: list[int],
    stacked: bool,
    device: torch.device,
) -> Tensor:
    """(B, T, F): the most any output moved when token j took each value of ``chunk`` — one
    call, the unchanged rows first in it when ``stacked`` (else compared with ``base``)."""
    B, T, F = base.shape
    changed = ids.repeat(len(chunk) + int(stacked), 1).view(-1, B, T)  # (1 + K, B, T)
    for k, value in enumerate(chunk, start=int(stacked)):
        changed[k, :, j] = value  # every row at once
    out = outputs(fn, changed.view(-1, T).to(device)).view(-1, B, T, F)
    ref = out[0] if stacked else base
    return (out[int(stacked) :] - ref).abs().amax(0)


def dependence_scale(moved: Tensor, visible: Tensor) -> Tensor:
    """(T, F): S, the most each output moved, over rows, for a key its mask shows it."""
    seen = visible.to(moved.device)  # (B, T, T_key)
    scale = moved.new_zeros(moved.shape[2:])
    for j in range(moved.shape[0]):
        shown = torch.where(seen[:, :, j, None], moved[j], 0.0)  # (B, T, F)
        scale = torch.maximum(scale, shown.amax(0))
    return scale


def check_memory(base: Tensor, T: int) -> None:
    """The sweep keeps every output's largest move for every key: T · B · T · F numbers."""
    need = T * base.numel() * base.element_size()
    if need > MOVED_BYTES:
        B, _, F = base.shape
        raise ValueError(
            f"the value sweep would keep {need / 2**20:.3g} MiB (seq_len² · batch · outputs per "
            f"position = {T}² · {B} · {F}), above {MOVED_BYTES / 2**20:.3g} MiB: "
            "lower seq_len or batch"
        )


def stack_size(fn: Model, ids: Tensor, base: Tensor, N: int, device: torch.device) -> int:
    """How many values' rows one call can hold besides the unchanged rows: up to N within
    :data:`STACK_ELEMENTS`, or 0 when ``fn`` refuses a larger batch or its copies of one row
    differ (rows that interact, or rounding that depends on a row's place)."""
    B, T, F = base.shape
    k = min(N, STACK_ELEMENTS // (B * T * F) - 1)
    if k < min(N, STACK_LEAST):
        return 0
    try:
        out = outputs(fn, ids.repeat(k + 1, 1).to(device)).view(k + 1, B, T, F)
    except STACK_ERRORS:
        return 0
    return k if bool((out == out[:1]).all()) else 0


def chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[n : n + size] for n in range(0, len(items), size)]


def check_repeatable(drift: Tensor, tol: float, what: str) -> None:
    """Two calls on the same tokens agree within ``tol``, else no change can be blamed on a
    token (dropout left on is the usual cause, a nondeterministic kernel the rarer)."""
    worst = float(drift.max())
    if worst > tol:
        raise ValueError(
            f"the model gives different outputs for the same inputs (they moved by {worst:.3g}, "
            f"above the tolerance of {tol:.3g}, {what}): an audit needs a deterministic model — "
            "call model.eval() to switch dropout off, and use deterministic kernels"
        )


def gradient_reads(
    fn: Model,
    embedding: nn.Module,
    how: str,
    vocab_size: int,
    B: int,
    T: int,
    trials: int,
    scale: Tensor,
    gen: torch.Generator,
    rtol: float,
    device: torch.device,
) -> tuple[Tensor | None, str]:
    """(B, T, T) bool: True at (b, i, j) where d output_i / d embedding_j of row b is nonzero in
    some trial (above ``rtol`` × the largest over j), and where they were taken — or None and
    why they could not be.

    Output i's features are summed with random weights, each divided by that feature's ``scale``
    (S of :class:`Sweep`), so that a tiny output counts as much as a huge one beside it.
    """
    reads = torch.zeros(B, T, T, dtype=torch.bool)
    for _ in range(trials):
        ids = random_ids(vocab_size, B, T, gen).to(device)
        found, why = one_jacobian(fn, embedding, how, ids, scale, gen, rtol)
        if found is None:
            return None, why
        reads |= found
    times = "once" if trials == 1 else f"in each of {trials} trials"
    return reads, f"through {how}, d output_i / d embedding_j at all {T} positions, {times}"


def one_jacobian(
    fn: Model,
    embedding: nn.Module,
    how: str,
    ids: Tensor,
    scale: Tensor,
    gen: torch.Generator,
    rtol: float,
) -> tuple[Tensor | None, str]:
    captured: list[Tensor] = []

    def swap_in_leaf(module: nn.Module, args: object, out: Tensor) -> Tensor:
        leaf = out.detach().requires_grad_()  # gradients even where the weights are frozen
        captured.append(leaf)
        return leaf

    handle = embedding.register_forward_hook(swap_in_leaf)
    try:
        with torch.enable_grad():
            out = outputs(fn, ids)  # (B, T, F)
    finally:
        handle.remove()
    if len(captured) != 1 or captured[0].shape[:2] != ids.shape:
        return None, f"skipped: {how} ran {len(captured)} times in one call, not once on the ids"
    if not out.requires_grad:
        return None, f"skipped: the outputs carry no gradient back to {how}"
    (emb,) = captured  # (B, T, C)
    B, T = ids.shape
    top = scale.amax(-1, keepdim=True)  # (T, 1)
    # a feature that never moved is weighed like the position's largest; none below 1e-12 of it
    per = torch.where(top > 0, scale.clamp_min(1e-12 * top), 1.0).to(out.device, out.dtype)
    reads = torch.zeros(B, T, T, dtype=torch.bool)
    for i in range(T):
        weights = torch.randn(B, out.shape[-1], generator=gen).to(out.device, out.dtype) / per[i]
        (grad,) = torch.autograd.grad(
            (out[:, i] * weights).sum(), emb, retain_graph=i < T - 1, allow_unused=True
        )
        if grad is None:
            continue
        size = grad.detach().flatten(2).norm(dim=-1).cpu()  # (B, T)
        reads[:, i] = size > rtol * size.amax(-1, keepdim=True)
    return reads, ""
