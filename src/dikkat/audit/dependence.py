"""Which tokens each output depends on, against what a mask allows (docs/audit.md).

Notation: ``B`` batch, ``T`` positions, ``F`` output features, ``C`` embedding width; a pair
``(i, j)`` is (query position i whose output is watched, key position j whose token changes).

Two probes, both on random tokens:

* **perturbation** — change the token at j (every row at once, each to another random token)
  and see which outputs moved. A correct mask keeps the outputs it hides j from bit-identical
  (a masked weight is exactly 0, and so is its product with any value), so any change above a
  tolerance far below a real leak's effect is one.
* **Jacobian** — d output_i / d embedding_j, through the model's token embedding, for each
  query i (one backward pass each): exactly 0 where the mask hides j from i.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dikkat.audit.probe import (
    RTOL,
    Model,
    check_deterministic,
    device_of,
    evaluating,
    find_embedding,
    outputs,
    tolerance,
)
from dikkat.audit.report import Checked, MaskReport, describe, pairs
from dikkat.core.masks import Mask, as_mask, causal
from dikkat.validate import check_bool, check_int


def mask(
    fn: Model,
    declared: Mask | Tensor,
    vocab_size: int,
    seq_len: int = 16,
    *,
    batch: int = 2,
    trials: int = 2,
    seed: int = 0,
    rtol: float = RTOL,
    jacobian: bool = True,
    embedding: nn.Module | None = None,
    hops: int | None = None,
    device: torch.device | str | None = None,
    name: str = "mask",
) -> MaskReport:
    """Check that ``fn``'s output at each position depends exactly on the tokens ``declared``
    lets it see.

    Args:
        fn: token ids (B, T) (long) → outputs (B, T, …): a tensor, a tuple whose first item is
            one, or an object with ``.logits`` / ``.last_hidden_state`` (a Hugging Face output).
            A module is put in eval mode for the audit; any other callable must be
            deterministic (two calls on the same tokens are compared first).
        declared: the mask the model should implement, evaluated on the (B, 1, T, T) grid of
            positions 0 … T − 1 (head 0) — e.g. ``causal() & document(ids)``, or a bool tensor.
        vocab_size: token ids are drawn from 0 … vocab_size − 1.
        seq_len: T, the positions checked (small: the cost is ``trials · (T + 2)`` calls).
        batch: rows per call; a mask with a batch dimension (``padding``, ``document`` of
            (B, N) ids) must match it.
        trials: fresh random rows in which every key is perturbed once.
        seed: seeds the tokens, the perturbations and the Jacobian's projections.
        rtol: a change counts when it exceeds ``rtol`` × the largest |output| of the unperturbed
            call (its scale). A correct mask leaves hidden outputs bit-identical, so this only
            absorbs nondeterministic kernels; a real leak moves an output by a sizeable part of
            its scale (an off-by-one mask gives the extra key a weight near 1 / (i + 2)).
        jacobian: also take d output_i / d embedding_j (needs the token embedding).
        embedding: the module whose output the gradients are taken against; None finds it when
            ``fn`` is a model (``get_input_embeddings()``, ``tok_emb``, or its one embedding of
            ``vocab_size`` rows) and otherwise skips the Jacobian, saying so in the report.
        hops: how many steps of the mask a dependence may take. A model of L layers carries
            token j to position i along up to L steps of the mask (j → k in one layer, k → i
            in the next), and every position keeps its own token through the residual stream;
            so an output may depend on what the mask, with the diagonal added, reaches in L
            steps, and a leak is a dependence outside that. None (the default) takes every
            step: for causal, document, full, prefix-LM and padding masks that is the mask
            itself plus the diagonal, for a sliding window every earlier key — pass
            ``hops=n_layers`` to audit a window exactly.
        device: where the tokens are made; None takes the model's.
        name: what the report calls this audit.

    Returns:
        A :class:`~dikkat.audit.report.MaskReport`: ``.ok``, ``.leaks``, ``.first_leak``,
        ``.unread`` (allowed pairs never read: a warning), ``.checked``.
    """
    check_int("vocab_size", vocab_size, at_least=2)
    check_int("seq_len", seq_len)
    check_int("batch", batch)
    check_int("trials", trials)
    check_int("seed", seed, at_least=0)
    check_bool("jacobian", jacobian)
    check_int("hops", hops, optional=True)
    if embedding is not None and not isinstance(embedding, nn.Module):
        raise TypeError(f"embedding must be an nn.Module or None, got {type(embedding).__name__}")
    declared_mask = as_mask(declared)
    if declared_mask is None:
        raise TypeError("declared must be a dikkat Mask or a bool tensor, got None")
    where = device_of(fn, device)
    B, T = batch, seq_len
    allowed = declared_mask.materialize(B, 1, T, T, 0, where).expand(B, 1, T, T)[:, 0].cpu()
    gen = torch.Generator().manual_seed(seed)
    with evaluating(fn):
        read = perturbation_reads(fn, vocab_size, B, T, trials, gen, rtol, where)
        grads, how = None, "off (jacobian=False)"
        if jacobian:
            if embedding is not None:
                found, how = embedding, f"the given {type(embedding).__name__}"
            else:
                found, how = find_embedding(fn, vocab_size)
            if found is not None:
                grads, how = gradient_reads(fn, found, how, vocab_size, B, T, gen, rtol, where)
            else:
                how = f"skipped: {how}"
    reach = reachable(allowed, hops)
    gradient = grads if grads is not None else torch.zeros_like(read)
    outside = ~reach
    unread = allowed.any(0) & ~(read & allowed).any(0)
    checked = Checked(
        batch=B,
        seq_len=T,
        trials=trials,
        forward_passes=trials * (T + 2) + int(grads is not None),
        jacobian=how,
        rtol=rtol,
    )
    return MaskReport(
        name=name,
        declared=describe(declared_mask),
        allowed=allowed.any(0),
        read=(read | gradient).any(0),
        leaks=pairs(((read | gradient) & outside).any(0)),
        jacobian_leaks=pairs((gradient & outside).any(0)),
        unread=pairs(unread),
        checked=checked,
    )


def causality(
    fn: Model,
    vocab_size: int,
    seq_len: int = 16,
    *,
    batch: int = 2,
    trials: int = 2,
    seed: int = 0,
    rtol: float = RTOL,
    jacobian: bool = True,
    embedding: nn.Module | None = None,
    device: torch.device | str | None = None,
) -> MaskReport:
    """Check that no output depends on a later token: :func:`mask` against ``causal()``.

    A leak ``(i, j)`` (j > i) says the output at position i changed when the token at j did,
    or has a nonzero gradient with respect to it. The arguments are :func:`mask`'s (the causal
    mask is its own closure: ``hops`` changes nothing).

    >>> import dikkat
    >>> gpt = dikkat.GPT(dikkat.GPTConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2))
    >>> dikkat.audit.causality(gpt, 32, 8).ok
    True
    """
    return mask(
        fn,
        causal(),
        vocab_size,
        seq_len,
        batch=batch,
        trials=trials,
        seed=seed,
        rtol=rtol,
        jacobian=jacobian,
        embedding=embedding,
        device=device,
        name="causality",
    )


def reachable(allowed: Tensor, hops: int | None) -> Tensor:
    """(B, T, T) bool: where ``allowed`` with its diagonal added reaches in ``hops`` steps (None:
    any number), the dependences a stack of that many attention layers may build."""
    eye = torch.eye(allowed.shape[-1], dtype=torch.bool)
    step = (allowed | eye).float()
    reach = step
    for _ in range(allowed.shape[-1] if hops is None else hops - 1):
        grown = ((reach @ step) > 0).float()
        if torch.equal(grown, reach):
            break
        reach = grown
    return reach.bool()


def random_ids(vocab_size: int, B: int, T: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, vocab_size, (B, T), generator=gen)


def perturbation_reads(
    fn: Model,
    vocab_size: int,
    B: int,
    T: int,
    trials: int,
    gen: torch.Generator,
    rtol: float,
    device: torch.device,
) -> Tensor:
    """(B, T, T) bool: True at (b, i, j) where changing token j of row b moved output i."""
    read = torch.zeros(B, T, T, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(trials):
            ids = random_ids(vocab_size, B, T, gen)
            base = outputs(fn, ids.to(device))  # (B, T, F)
            check_deterministic(fn, ids.to(device), base, rtol)
            tol = tolerance(base, rtol)
            for j in range(T):
                changed = ids.clone()
                shift = torch.randint(1, vocab_size, (B,), generator=gen)
                changed[:, j] = (changed[:, j] + shift) % vocab_size  # another token, every row
                moved = (outputs(fn, changed.to(device)) - base).abs().amax(-1)  # (B, T)
                read[:, :, j] |= (moved > tol).cpu()
    return read


def gradient_reads(
    fn: Model,
    embedding: nn.Module,
    how: str,
    vocab_size: int,
    B: int,
    T: int,
    gen: torch.Generator,
    rtol: float,
    device: torch.device,
) -> tuple[Tensor | None, str]:
    """(B, T, T) bool: True at (b, i, j) where d output_i / d embedding_j of row b is nonzero
    (above ``rtol`` × the largest gradient of that output), and where they were taken — or
    None and why they could not be."""
    captured: list[Tensor] = []

    def swap_in_leaf(module: nn.Module, args: object, out: Tensor) -> Tensor:
        leaf = out.detach().requires_grad_()  # gradients even where the weights are frozen
        captured.append(leaf)
        return leaf

    ids = random_ids(vocab_size, B, T, gen).to(device)
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
    reads = torch.zeros(B, T, T, dtype=torch.bool)
    for i in range(T):
        weights = torch.randn(B, out.shape[-1], generator=gen).to(out.device, out.dtype)
        (grad,) = torch.autograd.grad(
            (out[:, i] * weights).sum(), emb, retain_graph=i < T - 1, allow_unused=True
        )
        if grad is None:
            continue
        size = grad.detach().float().flatten(2).norm(dim=-1).cpu()  # (B, T)
        reads[:, i] = size > rtol * size.amax(-1, keepdim=True)
    return reads, f"through {how}, d output_i / d embedding_j at all {T} output positions"
