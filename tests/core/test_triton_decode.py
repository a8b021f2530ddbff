"""triton_decode (flash-decoding in Triton) against the fp64 reference, under the 2× rule.

Without CUDA the kernels run under Triton's interpreter on CPU tensors, in fp32 only (it has no
bf16 arithmetic); with CUDA the same cases run in bf16 and fp16 on longer caches. The rule is
test_backends.py's: at most twice the error of the plain reference in the same dtype, plus a floor
of a few roundings of the summed terms.
"""

from __future__ import annotations

import importlib.util
import sys
import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: triton_decode cannot run", allow_module_level=True)
_loaded = sys.modules.get("dikkat.core.triton.decode_kernels")
if not CUDA and _loaded is not None and not _loaded.INTERPRETED:
    pytest.skip(
        "the decode kernels were loaded without Triton's interpreter before this module, and "
        "there is no CUDA to run them on",
        allow_module_level=True,
    )

from dikkat.core import attention, masks, repeat_kv  # noqa: E402
from dikkat.core.triton.decode import triton_decode  # noqa: E402
from helpers import Case, max_err, rounded, term_sizes  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    """TRITON_INTERPRET=1 while these tests run, without CUDA: triton.jit reads it when the
    decode kernels are first loaded (inside the first triton_decode call), and only this module
    may see it on (tests/conftest.py imported triton itself with it on)."""
    if CUDA:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32]
LENGTHS = [1, 37, 300, 4099] if CUDA else [1, 37, 300]  # ragged: partial last key blocks
# test_backends.py's floors: a few unit roundoffs of the summed terms (fp16: u = 2**-11)
FLOOR = {torch.float32: 32 * 2**-24, torch.bfloat16: 2 * 2**-9, torch.float16: 2 * 2**-11}
MASK_KINDS = ["none", "causal", "sliding_window", "padding", "document"]


def _case(kind: str, T: int, S: int, H: int = 8, G: int = 2, D: int = 64, B: int = 2) -> Case:
    """A decoding step: the T queries are the last positions (q_offset = S − T)."""
    q_offset = S - T
    mask: masks.Mask | None = None
    if kind == "causal":
        mask = masks.causal()
    elif kind == "sliding_window":
        mask = masks.sliding_window(16)
    elif kind == "padding":  # the second sequence has no real key: its rows see nothing
        mask = masks.padding(torch.tensor([S, 0][:B]))
    elif kind == "document":
        q_offset = max(q_offset, 0)  # document() places queries in a sequence: none before key 0
        ids = torch.arange(max(S, q_offset + T)) // 17  # packed documents of 17 tokens
        mask = masks.document(ids.repeat(B, 1))
    seed = zlib.crc32(repr((kind, T, S, H, G, D)).encode())
    return Case(B, H, G, T, S, D, D, q_offset, mask, None, seed)


def _decode(case: Case, inputs: dict, dtype: torch.dtype, split: int | None = None):
    q, k, v = (inputs[n].to(DEVICE, dtype) for n in "qkv")
    return triton_decode(
        q, k, v, case.mask, scale=case.D**-0.5, q_offset=case.q_offset, split=split
    )


def _reference(case: Case, inputs: dict, dtype: torch.dtype):
    q, k, v = (inputs[n].to(DEVICE, dtype) for n in "qkv")
    out, aux = attention(
        q, k, v, case.mask, q_offset=case.q_offset, backend="reference", return_lse=True
    )
    return out.cpu(), aux.lse.cpu()


def _check_two_x_rule(case: Case, dtype: torch.dtype, split: int | None = None):
    inputs = case.inputs()
    exact_out, exact_lse = _reference(case, rounded(inputs, dtype), torch.float64)
    plain_out, plain_lse = _reference(case, inputs, dtype)
    out, lse = _decode(case, inputs, dtype, split)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == dtype and out.shape == exact_out.shape
    assert lse.dtype == torch.float32 and lse.shape == exact_lse.shape

    empty = case.empty_rows()[..., 0]  # (B, H, T)
    assert (out[empty] == 0).all(), "a row with no visible key must give output 0"
    assert (lse[empty] == -torch.inf).all(), "a row with no visible key must give lse −inf"
    assert torch.isfinite(out).all() and torch.isfinite(lse[~empty]).all()

    terms = term_sizes(case, inputs, dtype).out
    bound = 2 * max_err(plain_out, exact_out) + FLOOR[dtype] * terms.max().item()
    err = max_err(out, exact_out)
    assert err <= bound, f"out in {dtype}: error {err:.3g} > bound {bound:.3g}"
    if not empty.all():
        assert exact_out[~empty].abs().max() > bound, "the comparison would be trivial"
        seen = ~empty
        x = rounded(inputs, dtype)
        k = repeat_kv(x["k"], case.group)  # (B, H, S, D)
        score = case.D**-0.5 * (x["q"].abs() @ k.abs().transpose(-2, -1)).max().item()
        lse_bound = 2 * max_err(plain_lse[seen], exact_lse[seen]) + FLOOR[dtype] * (1 + score)
        lse_err = max_err(lse[seen], exact_lse[seen])
        assert lse_err <= lse_bound, f"lse: error {lse_err:.3g} > bound {lse_bound:.3g}"
    return out, lse


@pytest.mark.parametrize("S", LENGTHS)
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_reference_for_every_mask(dtype, kind, T, S):
    _check_two_x_rule(_case(kind, T, S), dtype)


@pytest.mark.parametrize("D", [64, 80])  # 80 is padded to 128 in-kernel
@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_heads_and_head_dims(dtype, T, heads, D):
    H, G = heads
    _check_two_x_rule(_case("causal", T, LENGTHS[-1], H=H, G=G, D=D), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_head_dim_padded_past_128(dtype):
    """D = 200 runs in blocks of 256 dims, with fewer rows and keys per block."""
    _check_two_x_rule(_case("causal", 4, LENGTHS[-1], D=200), dtype)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_split_and_several_agree(dtype, kind):
    """The merge by lse is exact: one chunk of keys or many give the same rows (to rounding)."""
    case = _case(kind, 4, LENGTHS[-1])
    one = _check_two_x_rule(case, dtype, split=1)
    several = _check_two_x_rule(case, dtype, split=5)
    for a, b in zip(one, several, strict=True):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        assert torch.allclose(a[finite].float(), b[finite].float(), rtol=0, atol=4 * FLOOR[dtype])


def test_reads_a_view_into_a_longer_cache_and_keys_shared_by_the_batch():
    """k and v as they come from a preallocated cache (a slice along S) and with batch size 1."""
    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 2, 64, generator=g, dtype=torch.float64)
    cache = torch.randn(2, 1, 2, 512, 64, generator=g, dtype=torch.float64)  # (kv, B=1, G, S, D)
    k, v = cache[0, :, :, :200], cache[1, :, :, :200]  # (1, 2, 200, 64), not contiguous
    mask = masks.causal()
    args = dict(scale=0.125, q_offset=198)
    x = [t.to(dtype).double() for t in (q, k, v)]
    exact = attention(*x, mask, q_offset=198, backend="reference")
    out, _ = triton_decode(*(t.to(DEVICE, dtype) for t in (q, k, v)), mask, **args)
    plain = attention(*(t.to(dtype) for t in x), mask, q_offset=198, backend="reference")
    bound = 2 * max_err(plain, exact) + FLOOR[dtype] * v.abs().max().item()
    assert max_err(out.cpu(), exact) <= bound


def test_a_dense_bool_mask_and_no_visible_key_at_all():
    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 32, generator=g).to(DEVICE, dtype) for _ in range(3))
    allowed = torch.rand(1, 2, 3, 3, generator=g) < 0.5
    allowed[0, 1, 2] = False  # one row sees nothing
    out, lse = triton_decode(q, k, v, allowed.to(DEVICE), scale=0.2)
    exact, (_, exact_lse) = attention(
        q.double(), k.double(), v.double(), allowed.to(DEVICE), scale=0.2, return_lse=True
    )
    assert out[0, 1, 2].eq(0).all() and lse[0, 1, 2] == -torch.inf
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.double(), exact, atol=atol)
    assert torch.allclose(lse.double(), exact_lse, atol=atol)  # −inf where exact_lse is −inf
    nothing, none_lse = triton_decode(q, k, v, masks.padding(torch.tensor([0])), scale=0.2)
    assert nothing.eq(0).all() and none_lse.eq(-torch.inf).all()


def test_refuses_what_it_cannot_serve():
    q, k = torch.randn(1, 2, 17, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="1 to 16 queries"):
        triton_decode(q, k, k, scale=0.25)
    big = torch.randn(1, 2, 1, 320)
    with pytest.raises(ValueError, match="head dims up to 256"):
        triton_decode(big, big, big, scale=0.25)
    q = torch.randn(1, 2, 1, 16, requires_grad=True)
    with pytest.raises(ValueError, match="forward only"):
        triton_decode(q, k, k, scale=0.25)
    with pytest.raises(ValueError, match="split must be between"):
        triton_decode(q.detach(), k, k, scale=0.25, split=0)
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        triton_decode(q.detach().double(), k.double(), k.double(), scale=0.25)
    with pytest.raises(ValueError, match="does not divide"):
        triton_decode(q.detach(), torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), scale=0.25)
