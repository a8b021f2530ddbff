"""Which tokens each output depends on, against what a mask allows (docs/audit.md).

Notation: ``B`` batch, ``T`` positions, ``F`` output features, ``C`` embedding width; a pair
``(i, j)`` is (query position i whose output is watched, key position j whose token changes).

Two probes (:mod:`dikkat.audit.sweep`), both on random tokens and on a float64 copy of the model
where one can be made:

* **values** — set the token at j to each of many ids (every id of a small vocabulary) and see
  which outputs moved. A correct mask keeps the outputs it hides j from bit-identical (a masked
  weight is exactly 0, and so is its product with any value), so a move above a tolerance far
  below a real leak's effect is one; the tolerance is relative to each output's own dependence
  on the tokens its mask shows it.
* **Jacobian** — d output_i / d embedding_j, through the model's token embedding, for each
  query i (one backward pass each): exactly 0 where the mask hides j from i, for every
  direction in the embedding space.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dikkat.audit.probe import Model, device_of, dtype_name, evaluating, find_embedding, in_dtype
from dikkat.audit.report import Checked, MaskReport, describe, pairs
from dikkat.audit.sweep import Sweep, gradient_reads, random_ids, value_sweep
from dikkat.core.masks import Mask, as_mask, causal
from dikkat.validate import check_bool, check_float, check_int


def mask(
    fn: Model,
    declared: Mask | Tensor,
    vocab_size: int,
    seq_len: int = 16,
    *,
    batch: int = 2,
    trials: int = 2,
    values: int | None = None,
    seed: int = 0,
    rtol: float | None = None,
    dtype: torch.dtype | None = torch.float64,
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
            deterministic (two calls on the same tokens are compared in every trial).
        declared: the mask the model should implement, evaluated on the (B, 1, T, T) grid of
            positions 0 … T − 1 (head 0) — e.g. ``causal() & document(ids)``, or a bool tensor.
        vocab_size: token ids are drawn from 0 … vocab_size − 1.
        seq_len: T, the positions checked (the cost is ``trials · (T · N + 2)`` calls, N the
            values each key takes).
        batch: B, the rows of random tokens; a mask with a batch dimension (``padding``,
            ``document`` of (B, N) ids) must match it. When ``fn`` takes more rows, one call
            holds copies of the B rows for several values (row r a copy of row r mod B), so a
            function closed over a (B, …) tensor may tile it to the rows it is given.
        trials: fresh random rows in which every key takes its values.
        values: how many token ids each key takes in each trial, in every row: every id when
            ``vocab_size`` is at most this, else this many drawn afresh for each key and trial.
            None: every id of a vocabulary up to 256 (bytes), else 16. A leak that fires for
            one id alone is found for certain only when every id is tried
            (``values=vocab_size``).
        seed: seeds the tokens, the values drawn and the Jacobian's projections.
        rtol: output (i, f) reads key j when changing token j moves it by more than ``rtol``
            × the most it moved for a token its mask shows it (its own included): relative per
            output, so a tiny output beside a huge one is held to its own scale. None takes
            :data:`~dikkat.audit.probe.RTOL` of the dtype the probes run in — 1e-9 in float64,
            1e-6 in float32. A correct mask leaves hidden outputs bit-identical, so the
            tolerance only absorbs nondeterministic kernels. The Jacobian counts a gradient
            above ``rtol`` × output i's largest.
        dtype: the probes run a copy of the model in this dtype (float64: rounding near 1e-16,
            so a leak of 1e-5 of an output is unmistakable) when ``fn`` is a module, a bound
            method of one, or a ``functools.partial`` of either or with one among its
            arguments (``partial(model, mask=m)``); a plain function, a model whose copy
            fails, or None runs as given. The report says which.
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
        ``.unread`` (allowed pairs never read: a warning), ``.checked`` (what was varied, in
        which dtype, and the tolerance).
    """
    check_int("vocab_size", vocab_size, at_least=2)
    check_int("seq_len", seq_len)
    check_int("batch", batch)
    check_int("trials", trials)
    check_int("values", values, optional=True)
    check_int("seed", seed, at_least=0)
    check_float("rtol", rtol, low=0.0, optional=True)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
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
    reach = reachable(allowed, hops)
    gen = torch.Generator().manual_seed(seed)
    with evaluating(fn):
        probe_ids = random_ids(vocab_size, B, T, gen).to(where)
        run, given, precision = in_dtype(fn, embedding, dtype, probe_ids)
        with evaluating(run):
            sweep = value_sweep(run, vocab_size, B, T, trials, values, reach, gen, rtol, where)
            grads, how = jacobian_reads(run, given, jacobian, vocab_size, B, T, trials, sweep, gen)
    gradient = grads if grads is not None else torch.zeros_like(sweep.read)
    read = sweep.read | gradient
    outside = ~reach
    unread = allowed.any(0) & ~(sweep.read & allowed).any(0)
    checked = Checked(
        batch=B,
        seq_len=T,
        trials=trials,
        forward_passes=sweep.calls + trials * int(grads is not None),
        rows_per_call=sweep.rows,
        jacobian=how,
        rtol=sweep.rtol,
        values=sweep.values,
        vocab_size=vocab_size,
        precision=f"{dtype_name(sweep.scale.dtype)}, {precision}",
    )
    return MaskReport(
        name=name,
        declared=describe(declared_mask),
        allowed=allowed.any(0),
        read=read.any(0),
        leaks=pairs((read & outside).any(0)),
        jacobian_leaks=pairs((gradient & outside).any(0)),
        unread=pairs(unread),
        checked=checked,
    )


def jacobian_reads(
    fn: Model,
    embedding: nn.Module | None,
    wanted: bool,
    vocab_size: int,
    B: int,
    T: int,
    trials: int,
    sweep: Sweep,
    gen: torch.Generator,
) -> tuple[Tensor | None, str]:
    """The Jacobian's reads (:func:`~dikkat.audit.sweep.gradient_reads`), or None and why."""
    if not wanted:
        return None, "off (jacobian=False)"
    if embedding is not None:
        found, how = embedding, f"the given {type(embedding).__name__}"
    else:
        found, how = find_embedding(fn, vocab_size)
    if found is None:
        return None, f"skipped: {how}"
    where = sweep.scale.device
    return gradient_reads(
        fn, found, how, vocab_size, B, T, trials, sweep.scale, gen, sweep.rtol, where
    )


def causality(
    fn: Model,
    vocab_size: int,
    seq_len: int = 16,
    *,
    batch: int = 2,
    trials: int = 2,
    values: int | None = None,
    seed: int = 0,
    rtol: float | None = None,
    dtype: torch.dtype | None = torch.float64,
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
        values=values,
        seed=seed,
        rtol=rtol,
        dtype=dtype,
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
