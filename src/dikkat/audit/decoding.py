"""Two more facts an attention model must get right: decoding through its KV cache gives the
logits of a full forward, and it sees positions only if it is given them (docs/audit.md).

Notation: ``B`` batch, ``T`` positions, ``P`` prefill length, ``V`` vocabulary.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dikkat.audit.probe import Model, device_of, evaluating, output_tensor, outputs
from dikkat.generation.generate import decode_step
from dikkat.validate import check_bool, check_float, check_int

# a change counts above this fraction of the logits' scale, by dtype: the cached path runs
# other shapes through the kernels, so it matches a full forward only to rounding
KV_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}
# outputs equal within this fraction of their scale count as permuted, by dtype: only the order
# of a sum changes, while a random model's positions move its outputs far more
PERMUTATION_RTOL = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}


@dataclass(frozen=True)
class KVCacheReport:
    """Logits decoded through the cache against a full forward's, per position.

    ``errors[t]`` is max |cached − full| at position t (the first ``prefill`` from the prefill
    call, the rest one decode step each); a position fails above ``rtol`` × ``scale`` (the
    full forward's largest |logit|).
    """

    prefill: int
    errors: tuple[float, ...]
    scale: float
    rtol: float
    name: str = "kv cache"

    @property
    def first_bad(self) -> int | None:
        """The first position whose cached logits differ, or None."""
        tol = self.rtol * self.scale
        return next((t for t, e in enumerate(self.errors) if e > tol), None)

    @property
    def ok(self) -> bool:
        return self.first_bad is None

    def summary(self) -> str:
        worst = max(self.errors)
        steps = len(self.errors) - self.prefill
        done = f"prefill of {self.prefill} then {steps} one-token steps"
        if self.ok:
            return (
                f"{done} give the full forward's logits (max |Δ| {worst:.2g}, scale "
                f"{self.scale:.2g})"
            )
        t = self.first_bad
        where = "the prefill" if t < self.prefill else f"decode step {t - self.prefill + 1}"
        return (
            f"MISMATCH: position {t} ({where}) differs from the full forward by "
            f"{self.errors[t]:.3g}, above {self.rtol:g} × the logits' scale {self.scale:.3g}"
        )

    def coverage(self) -> str:
        """One line: what was compared, and the tolerance."""
        return (
            f"{len(self.errors)} positions of random tokens; a position fails above "
            f"{self.rtol:g} × the full forward's largest |logit| ({self.scale:.3g})"
        )

    def __str__(self) -> str:
        cells = " ".join(f"{e:.1e}" for e in self.errors)
        return (
            f"{self.name} audit: {'ok' if self.ok else 'FAILED'}\n"
            f"  result    {self.summary()}\n"
            f"  |Δ| by position  {cells}"
        )


def kv_cache(
    model: nn.Module,
    vocab_size: int | None = None,
    seq_len: int = 12,
    *,
    prefill: int | None = None,
    batch: int = 2,
    seed: int = 0,
    rtol: float | None = None,
) -> KVCacheReport:
    """Check that a prefill of ``prefill`` tokens and then one-token decode steps through the
    KV cache give the logits a full forward gives, at every position.

    ``model`` is a dikkat causal LM (``new_cache``; the steps run
    :func:`dikkat.generation.decode_step`, the path ``generate`` takes) or a Hugging Face one
    (``use_cache=True``, then ``past_key_values`` step by step). ``vocab_size`` defaults to
    ``model.config.vocab_size``; ``prefill`` to half of ``seq_len``; ``rtol`` (a fraction of the
    logits' largest magnitude) to one for the logits' dtype (:data:`KV_RTOL`).
    """
    if vocab_size is None:
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    check_int("vocab_size", vocab_size, at_least=2)
    check_int("seq_len", seq_len, at_least=2)
    P = seq_len // 2 if prefill is None else prefill
    check_int("prefill", P, at_most=seq_len - 1)
    check_int("batch", batch)
    check_int("seed", seed, at_least=0)
    check_float("rtol", rtol, low=0.0, optional=True)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device_of(model, None))
    with evaluating(model), torch.no_grad():
        full = output_tensor(model(ids)).float()  # (B, T, V)
        if hasattr(model, "new_cache"):
            cached = _dikkat_decode(model, ids, P)
        elif callable(getattr(model, "get_input_embeddings", None)):
            cached = _hf_decode(model, ids, P)
        else:
            raise TypeError(
                f"kv_cache needs a dikkat causal LM (new_cache) or a Hugging Face one "
                f"(past_key_values), got {type(model).__name__}"
            )
    errors = (cached.float() - full).abs().flatten(2).amax(-1).amax(0)  # (T,)
    tol = KV_RTOL.get(cached.dtype, 3e-2) if rtol is None else rtol
    return KVCacheReport(P, tuple(errors.tolist()), float(full.abs().max()), tol)


def _dikkat_decode(model: nn.Module, ids: Tensor, P: int) -> Tensor:
    B, T = ids.shape
    cache = model.new_cache(B, T)
    logits = [model(ids[:, :P], cache=cache)]  # (B, P, V)
    for t in range(P, T):
        logits.append(decode_step(model, ids[:, t], cache, t)[:, None])  # (B, 1, V)
    return torch.cat(logits, dim=1)


def _hf_decode(model: nn.Module, ids: Tensor, P: int) -> Tensor:
    # transformers 5 renamed past_key_values to cache (the old name warns); take the model's
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids[:, :P], use_cache=True)
    logits = [out.logits]
    for t in range(P, ids.shape[1]):
        out = model(ids[:, t : t + 1], **{key: getattr(out, key)}, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


@dataclass(frozen=True)
class PermutationReport:
    """Whether permuting a model's inputs permutes its outputs (equivariance), or, for a causal
    model, leaves the last output unchanged when the tokens before it are permuted.

    ``equivariant`` is the fact measured: True means the model is blind to order (no positions
    reach it); ``expect`` is what it should be (None: no expectation, always ok).
    """

    equivariant: bool
    expect: bool | None
    causal: bool
    max_diff: float
    scale: float
    permutation: tuple[int, ...]
    rtol: float  # outputs within rtol × scale count as equal
    name: str = "permutation"

    @property
    def ok(self) -> bool:
        return self.expect is None or self.equivariant == self.expect

    def summary(self) -> str:
        what = (
            "the last output did not change when the tokens before it were permuted"
            if self.causal
            else "permuting the inputs permuted the outputs"
        )
        if self.equivariant:
            fact = f"{what}: the model is blind to position"
        else:
            fact = (
                f"permuting the inputs moved the outputs by {self.max_diff:.3g} (scale "
                f"{self.scale:.3g}): the model uses positions"
            )
        if not self.ok:
            want = "blind to position" if self.expect else "to use positions"
            fact = f"UNEXPECTED: {fact}, but it was expected {want}"
        return fact

    def coverage(self) -> str:
        """One line: the permutation, and the tolerance."""
        kept = ", the last position kept" if self.causal else ""
        return (
            f"permutation {list(self.permutation)}{kept}; outputs equal within {self.rtol:g} × "
            f"their largest |output| ({self.scale:.3g})"
        )

    def __str__(self) -> str:
        return (
            f"{self.name} audit: {'ok' if self.ok else 'FAILED'}\n  result    {self.summary()}\n"
            f"  checked   permutation {list(self.permutation)}"
            + (" (the last position kept)" if self.causal else "")
        )


def permutation(
    fn: Model,
    x: Tensor,
    *,
    causal: bool = False,
    expect: bool | None = None,
    seed: int = 0,
    rtol: float | None = None,
) -> PermutationReport:
    """Permute the positions of ``x`` (B, T, …) — token ids or vectors — and compare outputs.

    Self-attention without positions is permutation-equivariant: ``fn(x[:, π]) == fn(x)[:, π]``.
    A causal model is not (the mask orders the tokens), but without positions its last output
    reads the tokens before it as a set: with ``causal=True`` the first T − 1 positions are
    permuted and only the last output compared. Positions (learned, sinusoidal, RoPE, ALiBi)
    break both. ``expect`` says which is right for this model (True: blind to position);
    outputs within ``rtol`` × their scale count as equal (a permuted sum rounds differently;
    default by the outputs' dtype, :data:`PERMUTATION_RTOL`).
    """
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor (B, T, …), got {getattr(x, 'shape', type(x))}")
    check_bool("causal", causal)
    if expect is not None:
        check_bool("expect", expect)
    check_int("seed", seed, at_least=0)
    check_float("rtol", rtol, low=0.0, optional=True)
    n = x.shape[1] - 1 if causal else x.shape[1]
    if n < 2:
        raise ValueError(f"x has {x.shape[1]} positions: too few to permute (causal={causal})")
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=gen)
    if bool((order == torch.arange(n)).all()):
        order = torch.roll(order, 1)  # a permutation that moves something
    perm = torch.cat([order, torch.arange(n, x.shape[1])]).to(x.device)
    with evaluating(fn), torch.no_grad():
        y = outputs(fn, x)  # (B, T, F)
        y_perm = outputs(fn, x[:, perm])
    if causal:
        diff = float((y_perm[:, -1] - y[:, -1]).abs().max())
    else:
        diff = float((y_perm - y[:, perm]).abs().max())
    scale = float(y.abs().max())
    rtol = PERMUTATION_RTOL.get(y.dtype, 1e-2) if rtol is None else rtol
    return PermutationReport(
        diff <= rtol * scale, expect, causal, diff, scale, tuple(perm.tolist()), rtol
    )
