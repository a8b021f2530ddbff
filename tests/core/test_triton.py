"""The triton backend against the fp64 reference, forward and backward, mask by mask.

Without CUDA the kernels run in triton's interpreter (TRITON_INTERPRET=1, on CPU tensors, fp32
only, slow: small shapes, few cases); with CUDA the same tests run them on the GPU in bf16 and
fp16 on larger shapes. The rule is test_backends.py's: at most twice the plain reference's error
in the same dtype from the fp64 oracle, plus a floor of a few roundings of the summed terms.

tests/conftest.py imports triton with the interpreter on (it must be on at triton's first
import); this module turns it on only while its own tests run, so that elsewhere the backend
declines CPU tensors as it does outside the tests.
"""

from __future__ import annotations

import math

import pytest
import torch

import dikkat
from dikkat.core import attention, explain, masks
from dikkat.core.triton import installed, triton_attention, unsupported
from helpers import Case, max_err, oracle, run, term_sizes
from layouts import Layout, run_relaid, values

if not installed():
    pytest.skip("triton is not installed (pip install 'dikkat[gpu]')", allow_module_level=True)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# the interpreter has no bf16/fp16 arithmetic
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32]
T, S = (300, 517) if CUDA else (37, 50)  # ragged: neither is a multiple of a block
FLOOR = {torch.float32: 32 * 2**-24, torch.bfloat16: 2 * 2**-9, torch.float16: 2 * 2**-11}


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    """TRITON_INTERPRET=1 while these tests run, without CUDA."""
    if CUDA:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        probe = torch.zeros(1, 1, 1, 16)
        reason = unsupported(probe, None)
        if reason is not None:  # e.g. triton imported before the interpreter could be turned on
            pytest.skip(f"triton's interpreter cannot run the kernels here: {reason}")
        yield


def _check(
    case: Case, dtype: torch.dtype, device: str = DEVICE, lay: dict[str, Layout] | None = None
) -> None:
    """The 2× rule for out, dq, dk, dv; the lse against the reference's; empty rows exactly 0.
    ``lay``: q, k, v, the bias and the output's gradient in these memory layouts
    (tests/layouts.py); None: contiguous."""
    inputs = case.inputs() if lay is None else values(case.inputs(), lay)
    exact = oracle(case, inputs, dtype)
    plain = run(case, inputs, dtype, "reference")
    on_device = {n: None if t is None else t.to(device) for n, t in inputs.items()}
    if lay is None:
        got = run(case, on_device, dtype, "triton")
    else:
        got, _ = run_relaid(case, inputs, dtype, "triton", lay, device=device)
    terms = term_sizes(case, inputs, dtype)
    for (name, x), (_, p), (_, e), (_, t) in zip(
        got.items(), plain.items(), exact.items(), terms.items(), strict=True
    ):
        x = x.cpu()
        assert x.dtype == dtype and x.shape == e.shape, name
        assert torch.isfinite(x).all(), f"{name} has non-finite entries"
        bound = 2 * max_err(p, e) + FLOOR[dtype] * t.max().item()
        err = max_err(x, e)
        assert err <= bound, f"triton {name} in {dtype}: error {err:.3g} > bound {bound:.3g}"
    empty = case.empty_rows()
    assert (got.out.cpu().masked_select(empty) == 0).all()
    assert (got.dq.cpu().masked_select(empty) == 0).all()
    _check_lse(case, on_device, dtype)


def _check_lse(case: Case, inputs: dict, dtype: torch.dtype) -> None:
    q, k, v = (inputs[n].to(dtype) for n in "qkv")
    bias = None if inputs["bias"] is None else inputs["bias"].to(dtype)
    args = dict(bias=bias, q_offset=case.q_offset, return_lse=True)
    _, (_, lse) = attention(q, k, v, case.mask, backend="triton", **args)
    _, (_, want) = attention(*(t.cpu().double() for t in (q, k, v)), case.mask, **{
        **args, "bias": None if bias is None else bias.cpu().double()
    })  # fmt: skip
    assert lse.dtype == torch.float32 and lse.shape == want.shape
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(want))  # −inf: rows that see no key
    finite = torch.isfinite(want)
    tol = 64 * (2**-24 if dtype == torch.float32 else 2**-8) * (1 + want[finite].abs().max())
    assert max_err(lse.cpu()[finite], want[finite]) <= tol


def _case(mask, *, B=2, H=2, G=1, t=T, s=S, D=32, Dv=None, q_offset=0, bias=None, seed=0,
          shared_kv=False) -> Case:  # fmt: skip
    return Case(B, H, G, t, s, D, Dv or D, q_offset, mask, bias, seed, shared_kv)


def _ids(n: int) -> torch.Tensor:
    """Two rows of packed documents over n positions, of uneven lengths."""
    first = torch.arange(n) // 11
    second = (torch.arange(n) >= n // 3).long() + (torch.arange(n) >= n - 5).long()
    return torch.stack([first, second])


MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(),
    "sliding_window": lambda: masks.sliding_window(9),
    "window_ahead": lambda: masks.sliding_window(5, ahead=3),
    "document": lambda: masks.document(_ids(max(T, S))),
    "padding": lambda: masks.padding(torch.tensor([S, S // 3])),
    "padding_valid": lambda: masks.padding(valid=torch.rand(2, S, generator=_gen()) < 0.6),
    "prefix_lm": lambda: masks.prefix_lm(torch.tensor([7, 20])),
    "and": lambda: masks.causal() & masks.padding(torch.tensor([S - 3, 17])),
    "or": lambda: masks.sliding_window(6) | masks.prefix_lm(5),
    "not": lambda: ~masks.sliding_window(4),
    "dense": lambda: torch.rand(2, 1, T, S, generator=_gen()) < 0.5,
}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(MASKS))
def test_every_mask_kind_matches_the_oracle(kind: str, dtype: torch.dtype) -> None:
    _check(_case(MASKS[kind](), seed=len(kind)), dtype)


CASES = {
    # grouped-query (2 query heads per key/value head) and multi-query
    "gqa_causal": dict(mask=masks.causal(), H=4, G=2),
    "mqa_document": dict(mask=masks.document(_ids(max(T, S))), H=4, G=1),
    # head dims: a power of two, one that is not (padded to 128 in the kernel), Dv ≠ D
    "d64": dict(mask=None, D=64, B=1),
    "d80_causal": dict(mask=masks.causal(), D=80, B=1),
    "dv_differs": dict(mask=masks.sliding_window(12), D=32, Dv=48, B=1),
    # T ≠ S: the queries are the last keys (bottom-right), or sit before key 0 (T > S)
    "bottom_right": dict(mask=masks.causal(), q_offset=S - T),
    "before_key_0": dict(mask=masks.causal(), t=S, s=T, q_offset=T - S),
    "window_before_key_0": dict(mask=masks.sliding_window(7), t=S, s=T, q_offset=T - S),
    # decoding: one query, then a few, at the end of a cache
    "decode_1": dict(mask=masks.causal(), t=1, q_offset=S - 1, H=4, G=2),
    "decode_3": dict(mask=masks.sliding_window(16), t=3, q_offset=S - 3, H=4, G=1),
    # additive bias, broadcast over the batch, with a mask; keys shared by the batch
    "bias": dict(mask=masks.causal(), bias=(1, 2, T, S)),
    "bias_row": dict(mask=None, bias=(2, 1, 1, S)),
    "shared_kv": dict(mask=masks.padding(torch.tensor([S, 9])), shared_kv=True),
    # every key of the second sequence padded away: its rows see nothing
    "empty_rows": dict(mask=masks.padding(torch.tensor([S - 1, 0]))),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_layouts_and_offsets_match_the_oracle(name: str, dtype: torch.dtype) -> None:
    _check(_case(**CASES[name], seed=len(name)), dtype)


# q, k, v, the bias and the output's gradient as views with other strides: transposed, sliced,
# channels-last, expanded (stride 0)
STRIDED = {
    "transposed_k": {"q": ("channels_last", 0), "k": ("transposed", 0), "v": ("every_other", 0),
                     "bias": ("transposed", 0), "dout": ("expanded", 3)},
    "expanded_k": {"q": ("narrowed", 0), "k": ("expanded", 2), "v": ("column_major", 0),
                   "bias": ("expanded", 2), "dout": ("column_major", 0)},
}  # fmt: skip


@pytest.mark.parametrize("name", list(STRIDED))
def test_strided_inputs_match_the_oracle(name: str) -> None:
    case = _case(masks.causal(), B=1, bias=(1, 2, T, S), seed=len(name))
    _check(case, DTYPES[0], lay=STRIDED[name])


def test_skipped_key_blocks_are_never_loaded() -> None:
    """NaN keys and values in blocks outside every later query block's window leave those
    queries' rows exact: the kernel never loaded them (a loaded NaN value would reach the
    output through 0 · NaN). The public function, not attention(), which would catch the NaN."""
    from dikkat.core.triton.launch import choose_blocks

    block = choose_blocks(32, 32, interpreted=not CUDA)[0]
    n, window = 4 * block, 5
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).to(DEVICE) for _ in range(3))
    k[:, :, :block], v[:, :, :block] = float("nan"), float("nan")  # the first key block
    out, _ = triton_attention(q, k, v, masks.sliding_window(window))
    clean = 2 * block  # rows whose windows start past the first key block's end
    want = attention(q[:, :, clean:].double(), k.double(), v.double(),
                     masks.sliding_window(window), q_offset=clean)  # fmt: skip
    assert torch.isfinite(out[:, :, clean:]).all()
    assert max_err(out[:, :, clean:].cpu(), want.cpu()) < (1e-2 if CUDA else 1e-5)


def test_a_mask_of_the_callers_own_runs_through_its_tiles() -> None:
    class EveryThird(dikkat.masks.Mask):
        def predicate(self, b, h, q_idx, kv_idx):
            return (q_idx + kv_idx) % 3 != 0

    _check(_case(EveryThird(), B=1), DTYPES[0])


def test_auto_never_picks_the_interpreter() -> None:
    if CUDA:
        pytest.skip("on CUDA the kernels are not interpreted")
    q = torch.randn(1, 1, 1024, 16)  # large enough that SDPA steps aside for a narrow window
    text = explain(q, q, q, masks.sliding_window(64))
    assert text.startswith("tiled (not sdpa: ")
    assert "not triton: off CUDA it runs in triton's interpreter" in text
    assert explain(q, q, q, masks.causal()).startswith("sdpa (the first choice)")


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(return_weights=True), "never holds the full weights"),
        (dict(dropout=0.1), "no dropout"),
        (dict(softcap=30.0), "cannot soft-cap"),
        (dict(bias=torch.zeros(8, 8, requires_grad=True)), "no gradient for the bias"),
        (dict(dtype=torch.float64), "float64"),
        (dict(D=8), "head dim must be 16 … 256, got 8"),
    ],
    ids=["weights", "dropout", "softcap", "bias_grad", "fp64", "small_head_dim"],
)
def test_what_it_cannot_serve_it_says(kwargs: dict, reason: str) -> None:
    dtype, D = kwargs.pop("dtype", DTYPES[0]), kwargs.pop("D", 16)
    q = torch.randn(1, 2, 8, D, dtype=dtype, device=DEVICE)
    if "bias" in kwargs:
        kwargs["bias"] = kwargs["bias"].to(DEVICE)
    with pytest.raises(ValueError, match="backend 'triton' cannot serve this call: .*" + reason):
        attention(q, q, q, backend="triton", **kwargs)


def test_no_score_cells_give_zeros_and_no_key_seen() -> None:
    q = torch.randn(1, 2, 5, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 2, 0, 16, device=DEVICE, requires_grad=True)
    out, lse = triton_attention(q, k, k)
    assert out.shape == (1, 2, 5, 16) and (out == 0).all()
    assert (lse == -math.inf).all()
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert (dq == 0).all()


def test_a_decoding_step_over_a_long_cache_runs_the_split_k_kernel(monkeypatch) -> None:
    """backend="triton" sends a few queries over a long cache, with no gradient, to
    triton_decode (flash-decoding), and gives the reference's output and lse there."""
    from dikkat.core import backends

    calls = []
    decode = backends.triton_decode
    monkeypatch.setattr(
        backends, "triton_decode", lambda *a, **kw: calls.append(1) or decode(*a, **kw)
    )
    S = backends.DECODE_MIN_KEYS + 37
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 2, 32, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 2, S, 32, generator=g).to(DEVICE) for _ in range(2))
    with torch.no_grad():
        out, aux = attention(q, k, v, masks.causal(), q_offset=S - 2, backend="triton",
                             return_lse=True)  # fmt: skip
    assert calls == [1]
    want, want_aux = attention(q.double(), k.double(), v.double(), masks.causal(),
                               q_offset=S - 2, return_lse=True)  # fmt: skip
    tol = 2e-2 if CUDA else 1e-5
    assert max_err(out.cpu(), want.cpu()) < tol
    assert max_err(aux.lse.cpu(), want_aux.lse.cpu()) < tol
    q.requires_grad_()  # with a gradient to come, the main kernel serves the same call
    attention(q, k, v, masks.causal(), q_offset=S - 2, backend="triton")
    assert calls == [1]
