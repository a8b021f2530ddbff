"""Shared test helpers: attention cases drawn by hypothesis, running a backend forward and
backward, and the fp64 oracle.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` query length, ``S`` key
length, ``D`` query/key head dim, ``Dv`` value head dim.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import strategies as st
from torch import Tensor

from dikkat.core import attention, available_backends, masks, repeat_kv
from dikkat.core.masks import Mask

HEAD_DIMS = (8, 16, 32)

# backends whose kernels run on CUDA only (off it, in triton's interpreter, in their own test
# file: tests/core/test_triton.py): the tests that run every backend on CPU tensors leave them out
GPU_BACKENDS = ("triton",)


def cpu_backends(*, exact_only: bool = False) -> list[str]:
    """The registered backends that run the tests' CPU tensors."""
    return [b for b in available_backends(exact_only=exact_only) if b not in GPU_BACKENDS]


@dataclass(frozen=True)
class Case:
    """One attention call: sizes, mask, bias layout and the seed of its random tensors."""

    B: int
    H: int
    G: int
    T: int
    S: int
    D: int
    Dv: int
    q_offset: int
    mask: Mask | Tensor | None  # a bare tensor is wrapped by attention() at q_offset
    bias_shape: tuple[int, ...] | None  # broadcastable to (B, H, T, S)
    seed: int
    shared_kv: bool = False  # k and v of batch size 1, shared by the B sequences of q

    @property
    def kv_batch(self) -> int:
        return 1 if self.shared_kv else self.B

    @property
    def group(self) -> int:
        return self.H // self.G

    def inputs(self) -> dict[str, Tensor | None]:
        """q, k, v, bias and an upstream gradient ``dout``, all float64."""
        g = torch.Generator().manual_seed(self.seed)

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        return {
            "q": randn(self.B, self.H, self.T, self.D),
            "k": randn(self.kv_batch, self.G, self.S, self.D),
            "v": randn(self.kv_batch, self.G, self.S, self.Dv),
            "bias": None if self.bias_shape is None else randn(*self.bias_shape),
            "dout": randn(self.B, self.H, self.T, self.Dv),
        }

    def allowed(self) -> Tensor:
        """The mask as a dense (B, H, T, S) bool tensor (all True without a mask)."""
        full = (self.B, self.H, self.T, self.S)
        if self.mask is None:
            return torch.ones(full, dtype=torch.bool)
        m = masks.as_mask(self.mask, self.q_offset)
        return m.materialize(*full, self.q_offset).expand(full)

    def empty_rows(self) -> Tensor:
        """(B, H, T, 1): True for queries that may attend to no key."""
        return ~self.allowed().any(dim=-1, keepdim=True)


@dataclass(frozen=True)
class Result:
    """A backend's output and the gradients of q, k, v under the case's upstream gradient."""

    out: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor

    def items(self) -> list[tuple[str, Tensor]]:
        return [("out", self.out), ("dq", self.dq), ("dk", self.dk), ("dv", self.dv)]


def rounded(inputs: dict[str, Tensor | None], dtype: torch.dtype) -> dict[str, Tensor | None]:
    """The inputs as the dtype holds them, carried back to float64 (what the oracle sees)."""
    return {k: None if t is None else t.to(dtype).double() for k, t in inputs.items()}


def run(
    case: Case,
    inputs: dict[str, Tensor | None],
    dtype: torch.dtype,
    backend: str,
    **kwargs,
) -> Result:
    """Run ``attention`` in ``dtype`` forward, then backward under ``inputs['dout']``."""
    q, k, v = (inputs[n].to(dtype).requires_grad_() for n in "qkv")
    bias = inputs["bias"]
    out = attention(
        q,
        k,
        v,
        case.mask,
        bias=None if bias is None else bias.to(dtype),
        q_offset=case.q_offset,
        backend=backend,
        **kwargs,
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs["dout"].to(dtype))
    return Result(out.detach(), dq, dk, dv)


def oracle(case: Case, inputs: dict[str, Tensor | None], dtype: torch.dtype) -> Result:
    """The reference in float64 on the inputs exactly as ``dtype`` holds them. Keys and values
    shared by the batch are copied out to every sequence first, and their gradients summed back
    over the batch: no broadcasting of dikkat's own is trusted."""
    x = rounded(inputs, dtype)
    if not case.shared_kv:
        return run(case, x, torch.float64, "reference")
    for name in "kv":
        x[name] = x[name].repeat(case.B, 1, 1, 1)  # a copy per sequence
    got = run(case, x, torch.float64, "reference")
    return Result(got.out, got.dq, got.dk.sum(0, keepdim=True), got.dv.sum(0, keepdim=True))


def max_err(x: Tensor, exact: Tensor) -> float:
    return (x.double() - exact).abs().max().item()


def term_sizes(case: Case, inputs: dict[str, Tensor | None], dtype: torch.dtype) -> Result:
    """For each entry of out, dq, dk, dv: the sum of the absolute values of the terms it adds up.

    Rounding errors scale with these, not with the result, which can cancel to 0 (with one
    allowed key dq = dk = 0 exactly). With P the weights and dP = dout·Vᵀ (whose terms are
    bounded by |dout|·|V|ᵀ):
    out = P·V, dv = Pᵀ·dout, dS = P∘(dP − rowsum(P∘dP)), dq = scale·dS·K, dk = scale·dSᵀ·Q.
    """
    x = rounded(inputs, dtype)
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    group, scale = case.group, case.D**-0.5
    _, (P, _) = attention(
        q, k, v, case.mask, bias=x["bias"], q_offset=case.q_offset, return_weights=True
    )  # (B, H, T, S)
    k, v = repeat_kv(k, group), repeat_kv(v, group)  # (B, H, S, D), (B, H, S, Dv)
    dP = dout.abs() @ v.abs().transpose(-2, -1)  # (B, H, T, S): bounds |dP| term by term
    dS = P * (dP + (P * dP).sum(dim=-1, keepdim=True))

    def per_kv_head(t: Tensor) -> Tensor:  # (B, H, S, ·) → (B, G, S, ·): a group's heads add up
        t = t.unflatten(1, (case.G, group)).sum(dim=2)
        return t.sum(0, keepdim=True) if case.shared_kv else t  # and a shared k's sequences

    return Result(
        out=P @ v.abs(),
        dq=scale * dS @ k.abs(),
        dk=per_kv_head(scale * dS.transpose(-2, -1) @ q.abs()),
        dv=per_kv_head(P.transpose(-2, -1) @ dout.abs()),
    )


def dbias_terms(case: Case, x: dict[str, Tensor | None]) -> Tensor:
    """Per bias entry, the sum of |terms| its gradient adds up: |P|·(|dP| + |rowsum(P∘dP)|)
    with |dP| ≤ |dout|·|V|ᵀ, summed over the dims the bias broadcasts along."""
    _, (P, _) = attention(x["q"], x["k"], x["v"], case.mask, bias=x["bias"],
                          q_offset=case.q_offset, return_weights=True)  # fmt: skip
    v = repeat_kv(x["v"], case.group)
    dP = x["dout"].abs() @ v.abs().transpose(-2, -1)
    dS = P * (dP + (P * dP).sum(-1, keepdim=True))
    b = x["bias"]
    return dS.sum_to_size((1,) * (4 - b.dim()) + tuple(b.shape)).view(b.shape)


# --- hypothesis strategies ------------------------------------------------------------------------


def broadcast_shapes(full: tuple[int, ...]) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes broadcastable to ``full``: each dim kept or 1, some leading dims dropped."""

    @st.composite
    def shapes(draw) -> tuple[int, ...]:
        kept = tuple(n if draw(st.booleans()) else 1 for n in full)
        drop = draw(st.integers(0, len(full) - 1))
        return kept[drop:]

    return shapes()


def _random_bool(shape: tuple[int, ...], seed: int, p_true: float = 0.7) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < p_true


def dense_tensors(B: int, H: int, T: int, S: int) -> st.SearchStrategy[Tensor]:
    """Random bool tensors broadcastable to (B, H, T, S), mostly True."""
    return st.tuples(broadcast_shapes((B, H, T, S)), st.integers(0, 2**31 - 1)).map(
        lambda shape_seed: _random_bool(*shape_seed)
    )


def mask_leaves(B: int, H: int, T: int, S: int, q_offset: int) -> dict[str, st.SearchStrategy]:
    """Every built-in mask, with parameters that fit a (B, H, T, S) call at ``q_offset``."""
    N = max(q_offset + T, S)  # positions a document-id row must cover
    seeds = st.integers(0, 2**31 - 1)
    batch_ints = st.lists(st.integers(0, S), min_size=B, max_size=B).map(torch.tensor)

    @st.composite
    def document_ids(draw) -> Tensor:
        rows = draw(st.sampled_from([1, B]))
        # Packed documents are runs of equal ids: a new document starts wherever a flag is set.
        starts = draw(st.lists(st.booleans(), min_size=rows * N, max_size=rows * N))
        return torch.tensor(starts).view(rows, N).long().cumsum(dim=1)

    leaves = {
        "causal": st.just(masks.causal()),
        # look-ahead windows too: 0 (causal) half of the time, else up to past the last key
        "sliding_window": st.builds(
            masks.sliding_window,
            st.integers(1, S + 1),
            ahead=st.one_of(st.just(0), st.integers(1, S + 1)),
        ),
        # a length of 0 masks every key of that sequence
        "padding": batch_ints.map(masks.padding),
        "padding_valid": seeds.map(lambda s: masks.padding(valid=_random_bool((B, S), s))),
        "document": document_ids().map(masks.document),
        "prefix_lm": st.one_of(st.integers(0, S), batch_ints).map(masks.prefix_lm),
        "dense": dense_tensors(B, H, T, S).map(lambda t: masks.dense(t, q_offset)),
    }
    if q_offset < 0:  # queries before key 0: the masks that place queries in a sequence refuse
        for kind in BEFORE_KEY_0_REFUSED:
            del leaves[kind]
    return leaves


# the mask kinds that refuse a negative q_offset (a query before key 0 has no document, and is
# neither in the prefix nor after it)
BEFORE_KEY_0_REFUSED = ("document", "prefix_lm")


MASK_KINDS = (
    "none",
    "causal",
    "sliding_window",
    "padding",
    "padding_valid",
    "document",
    "prefix_lm",
    "dense",
    "bare_tensor",
    "and",
    "or",
    "not",
    "nested",
)


def mask_strategy(B: int, H: int, T: int, S: int, q_offset: int, kind: str) -> st.SearchStrategy:
    """Masks of one kind (see ``MASK_KINDS``) for a (B, H, T, S) call at ``q_offset``."""
    leaves = mask_leaves(B, H, T, S, q_offset)
    any_leaf = st.one_of(*leaves.values())
    if kind in leaves:
        return leaves[kind]
    if kind == "none":
        return st.none()
    if kind == "bare_tensor":  # what most callers pass; attention() wraps it at q_offset
        return dense_tensors(B, H, T, S)
    if kind == "and":
        return st.tuples(any_leaf, any_leaf).map(lambda lr: lr[0] & lr[1])
    if kind == "or":
        return st.tuples(any_leaf, any_leaf).map(lambda lr: lr[0] | lr[1])
    if kind == "not":
        return any_leaf.map(lambda m: ~m)
    if kind == "nested":
        return st.recursive(
            any_leaf,
            lambda inner: st.one_of(
                st.tuples(inner, inner).map(lambda lr: lr[0] & lr[1]),
                st.tuples(inner, inner).map(lambda lr: lr[0] | lr[1]),
                inner.map(lambda m: ~m),
            ),
            max_leaves=4,
        )
    raise ValueError(f"unknown mask kind {kind!r}; choose one of {MASK_KINDS}")


@st.composite
def attention_cases(
    draw,
    *,
    mask_kind: str | None = None,
    bias: bool | None = None,
    max_len: int = 24,
    shared_kv: bool | None = None,
) -> Case:
    """A random attention call.

    ``mask_kind`` fixes the kind of mask (one of ``MASK_KINDS``; None: any); ``bias`` True/False
    forces a bias on/off (None: either); ``shared_kv`` True/False forces k and v of batch size 1
    (shared by q's sequences) or of q's batch size (None: either).
    """
    B = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    H = G * draw(st.integers(1, 3))
    kind = draw(st.sampled_from(MASK_KINDS)) if mask_kind is None else mask_kind
    places = ["start", "cache"] + ([] if kind in BEFORE_KEY_0_REFUSED else ["before"])
    place = draw(st.sampled_from(places))
    if place == "cache":
        # Decoding with a cache: the T queries sit at q_offset … q_offset + T − 1 and the keys
        # run from 0 to at least the last query.
        T = draw(st.integers(1, max_len - 1))
        q_offset = draw(st.integers(1, max_len - T))
        S = draw(st.integers(T + q_offset, max_len))
    elif place == "before":
        # The first queries sit before key 0 (bottom-right alignment when T > S: q_offset = S − T)
        T = draw(st.integers(2, max_len))
        q_offset = draw(st.integers(1 - T, -1))
        S = draw(st.one_of(st.just(max(1, T + q_offset)), st.integers(1, max_len)))
    else:
        T, S, q_offset = draw(st.integers(1, max_len)), draw(st.integers(1, max_len)), 0
    D = draw(st.sampled_from(HEAD_DIMS))
    Dv = draw(st.one_of(st.just(D), st.sampled_from(HEAD_DIMS)))
    mask = draw(mask_strategy(B, H, T, S, q_offset, kind))
    with_bias = draw(st.booleans()) if bias is None else bias
    bias_shape = draw(broadcast_shapes((B, H, T, S))) if with_bias else None
    seed = draw(st.integers(0, 2**31 - 1))
    shared = draw(st.booleans()) if shared_kv is None else shared_kv
    return Case(B, H, G, T, S, D, Dv, q_offset, mask, bias_shape, seed, shared)


def scramble(
    model: torch.nn.Module,
    seed: int,
    fan_in: Callable[[str, torch.Tensor], int] = lambda name, p: p.shape[-1],
) -> torch.nn.Module:
    """Order-one weights instead of the std-0.02 inits, so logits are large and attention peaked
    enough for a 1e-5 parity bound to mean something: matrices std 1/√fan_in, norm gains 1 ± 0.1,
    biases ± 0.1. Tied parameters are one parameter and stay tied. Returns the model in eval mode.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(fan_in(name, p)))
            elif name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
    return model.eval()


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``dikkat argv`` in process: (exit code, stdout, stderr); argparse's exits count too."""
    from dikkat.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def shared_text(name: str, text: str) -> Path:
    """``text`` in the file ``name`` of the system's temporary folder, which the test processes
    share (pytest-xdist's workers each write it when they collect a module): each writes its own
    copy and renames it over the file, so a test never reads half of it."""
    path = Path(tempfile.gettempdir()) / name
    own = path.with_name(f".{name}.{os.getpid()}")
    own.write_text(text)
    os.replace(own, path)
    return path
