"""NaN and infinity in the inputs: which output rows they reach, for the rule every backend follows.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims, ``J`` the key columns that hold a non-finite value.

The rule (stated for users in :mod:`dikkat.core.attention`): output row i *reaches* q_i, every
key/value row j its mask allows, and every bias cell (i, j) its mask allows. A NaN or ±∞ in q, k
or v, or a NaN or +∞ in the bias, makes exactly the rows that reach it NaN, and no other row
changes. −∞ in the bias is not an error but SDPA's additive-mask convention: that key is hidden
from that query.

IEEE arithmetic alone does not give this. A masked weight is 0 and 0 · NaN = NaN, so a NaN value
row poisons every row through ``weights @ v`` (pytorch/pytorch#101967); an additive −∞ mask plus a
NaN score is NaN; PyTorch's CPU flash kernel returns 0 for a NaN query since torch 2.5
(pytorch/pytorch#141128); and a score of −∞ (a finite query against an infinite key) gives weight
0, a finite row that did reach the infinity. So after every call
:func:`needs_exact_path` looks at q, k and the output (and v when autograd is on; one reduction
each, one host sync), and only when it fires does dikkat run the slow exact path: the backend
again, on the inputs with their non-finite entries replaced by 0 (:func:`finite_part`), and the
rows :func:`reached_rows` finds set to NaN after.

None of that can run where tensor values never reach Python: inside ``torch.compile``,
``torch.export`` or ``torch.jit.trace`` a graph cannot branch on them, and under a ``torch.func``
transform (vmap, grad, jacrev) ``.item()`` is refused. There :func:`check_traced` keeps the rule
from failing silently: a non-finite q, k, v (or a NaN/+∞ bias cell) is an error instead of NaN
rows — a device-side assert in a traced graph (``torch._assert_async``: on CUDA it ends the
process's CUDA context, as any device-side assert does), and a ``ValueError`` from the values
under the transforms, read beneath their wrappers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dikkat.core.masks import Mask
from dikkat.core.reference import repeat_kv
from dikkat.core.tracing import check_traced as check_values
from dikkat.core.tracing import plain

_NOT_FINITE = (
    "dikkat.attention: q, k or v holds a NaN or ±inf (or the bias a NaN or +inf) inside a "
    "traced or transformed region ({where}), where the NaN rule's exact path cannot run "
    "(docs/attention.md, 'NaN and infinity')"
)

# cells per evaluation of the mask on the non-finite columns (a bound on the slow path's memory)
_CELLS = 1 << 22


def _finite_probe(x: Tensor) -> Tensor:
    """A scalar that is finite when every entry of x is (and, very rarely, non-finite for finite x,
    when the sum overflows: that only costs the slow path, which is exact for finite inputs too)."""
    x = x.detach()
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    if x.dtype == torch.float16:
        # a sum of activations passes fp16's 65504 easily; the extremes cannot overflow
        lo, hi = torch.aminmax(x)
        return lo.float() + hi.float()
    return x.sum().float()  # one pass in the input dtype: the cheapest reduction there is


def needs_exact_path(q: Tensor, k: Tensor, v: Tensor, out: Tensor, *, backward: bool) -> bool:
    """Whether a backend's output may break the rule: q, k or the output holds a NaN or ±∞, or,
    when a backward pass will follow, v does. One reduction each and one host sync.

    The output shows whatever v and the bias do wrong in the forward pass (a row poisoned through
    0 · NaN is NaN; a row that reaches a bad value or a NaN/+∞ bias cell is NaN or ∞), but not
    all that q and k do: PyTorch's CPU flash kernel returns 0 for a NaN query, and a finite query
    against an infinite key can score −∞, weight 0, a finite row that reached the infinity. The
    backward pass can meet a NaN value the forward pass hid (a fully masked row that a kernel
    computes and zeroes after: 0 · NaN in dP = dO Vᵀ), so with autograd v is looked at too."""
    if q.device.type == "meta":
        return False  # no values to look at
    probes = [_finite_probe(t) for t in ((q, k, out, v) if backward else (q, k, out))]
    if q.device.type == "cpu":  # host scalars cost no sync here, and are cheaper than a sum
        return not math.isfinite(sum(float(p) for p in probes))
    return not bool(torch.isfinite(torch.stack(probes).sum()))


def finite_part(x: Tensor) -> Tensor:
    """x with each NaN and ±∞ replaced by 0 (the gradient reaches the finite entries only)."""
    return torch.where(torch.isfinite(x), x, 0.0)


def bias_finite_part(bias: Tensor) -> Tensor:
    """The bias with each NaN and +∞ replaced by 0; −∞ stays (a hidden key)."""
    return torch.where(_bad_bias(bias), 0.0, bias)


def _bad_bias(bias: Tensor) -> Tensor:
    return torch.isnan(bias) | torch.isposinf(bias)


def _reach(
    mask: Mask | None, bad: Tensor, cols: Tensor, B: int, H: int, T: int, q_offset: int
) -> Tensor:
    """(B, H, T): rows whose mask allows some column ``cols[j]`` where ``bad`` (broadcastable
    to (B, H, T, J)) is True. The mask runs on those J columns only, a few query rows at a time."""
    if mask is None:
        return bad.any(-1).expand(B, H, T)
    device = bad.device
    reached = torch.zeros(B, H, T, dtype=torch.bool, device=device)
    rows = max(1, _CELLS // max(1, B * H * cols.numel()))
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        allowed = mask.evaluate(
            torch.arange(B, device=device),
            torch.arange(H, device=device),
            torch.arange(r0 + q_offset, r1 + q_offset, device=device),
            cols,
        )  # (B|1, H|1, R, J)
        tile = bad[:, :, r0:r1] if bad.shape[2] > 1 else bad
        reached[:, :, r0:r1] = (allowed & tile).any(-1)
    return reached


def reached_rows(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Mask | None, q_offset: int
) -> Tensor:
    """(B, H, T) bool: the output rows that reach a non-finite input (the module's rule).

    ``bias`` is viewed as (B|1, H|1, T|1, S|1), as :func:`dikkat.core.checks.check_bias` gives it.
    """
    B, H, T, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    reached = ~torch.isfinite(q).all(-1)  # (B, H, T): row i reaches q_i, masked or not
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (B, G, S)
    if bool(bad_kv.any()):
        cols = bad_kv.any(0).any(0).nonzero().flatten()  # (J,)
        bad = repeat_kv(bad_kv[:, :, cols].unsqueeze(2), H // G)  # (B, H, 1, J)
        reached |= _reach(mask, bad, cols, B, H, T, q_offset)
    if bias is not None:
        bad_b = _bad_bias(bias)  # (B|1, H|1, T|1, S|1)
        if bool(bad_b.any()):
            if bad_b.shape[3] == 1:  # one cell per row serves every key
                cols = torch.arange(S, device=q.device)
            else:
                cols = bad_b.any(0).any(0).any(0).nonzero().flatten()
                bad_b = bad_b[..., cols]
            reached |= _reach(mask, bad_b, cols, B, H, T, q_offset)
    return reached


def poison_rows(x: Tensor | None, reached: Tensor) -> Tensor | None:
    """x (B, H, T, ·) or (B, H, T) with the reached rows set to NaN."""
    if x is None:
        return None
    return x.masked_fill(reached if x.dim() == 3 else reached.unsqueeze(-1), float("nan"))


def _all_finite(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """A 0-d bool: every entry of q, k, v is finite, and no bias cell is NaN or +∞ (−∞ hides a
    key)."""
    ok = torch.isfinite(q).all() & torch.isfinite(k).all() & torch.isfinite(v).all()
    if bias is not None:
        ok = ok & ~_bad_bias(bias).any()
    return ok


def check_traced(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> None:
    """The NaN rule where values cannot reach Python (see the module's docstring): a
    non-finite input is an error, never a silently wrong row."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        where = "torch.compile, torch.export or torch.jit.trace"
    else:
        where = "a torch.func transform: vmap, grad, jacrev"
        q, k, v = (plain(t.detach()) for t in (q, k, v))
        bias = None if bias is None else plain(bias.detach())
    check_values(_all_finite(q, k, v, bias), _NOT_FINITE.format(where=where))
