"""Bad input raises, and the message names the argument (and the shapes, where shapes are wrong)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dikkat.core import (
    Backend,
    attention,
    available_backends,
    explain,
    masks,
    reference_attention,
    register_backend,
)

B, H, G, T, S, D = 2, 4, 2, 5, 6, 8


def qkv(dtype=torch.float32):
    """Valid q (B, H, T, D), k (B, G, S, D), v (B, G, S, D)."""
    return torch.randn(B, H, T, D, dtype=dtype), *torch.randn(2, B, G, S, D, dtype=dtype)


@pytest.fixture
def q():
    return qkv()[0]


@pytest.fixture
def k():
    return qkv()[1]


@pytest.fixture
def v():
    return qkv()[2]


# --- q, k, v --------------------------------------------------------------------------------------


def test_wrong_rank(q, k, v) -> None:
    with pytest.raises(
        ValueError, match=r"q must have 4 dims \(B, H, T, D\), got shape \(4, 5, 8\)"
    ):
        attention(q[0], k, v)
    with pytest.raises(
        ValueError, match=r"k must have 4 dims \(B, G, S, D\), got shape \(1, 1, 2, 6, 8\)"
    ):
        attention(q, k[None, :1], v)
    with pytest.raises(ValueError, match=r"v must have 4 dims"):
        attention(q, k, v[0])


@pytest.mark.parametrize("bad", [[[1.0]], np.zeros((B, G, S, D)), 3.0, None])
def test_not_a_tensor(q, k, v, bad) -> None:
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor"):
        attention(bad, k, v)
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor"):
        attention(q, k, bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool], ids=str)
def test_integer_dtype(q, k, v, dtype) -> None:
    with pytest.raises(TypeError, match=rf"k must be a floating-point tensor, got dtype {dtype}"):
        attention(q, k.to(dtype), v)


def test_dtypes_differ(q, k, v) -> None:
    with pytest.raises(TypeError, match=r"q, k, v must share a dtype.*float32.*float64"):
        attention(q, k.double(), v)
    with pytest.raises(TypeError, match=r"must share a dtype"):
        attention(q.bfloat16(), k.bfloat16(), v)


def test_batch_sizes_differ(q, k, v) -> None:
    # k and v may have batch size 1 (shared by q's sequences) or q's, and must agree
    k3, v3 = (torch.cat([t, t[:1]]) for t in (k, v))  # batch size 3 against q's 2
    with pytest.raises(ValueError, match=r"batch sizes differ: q \(2, 4, 5, 8\), k \(3, 2, 6, 8\)"):
        attention(q, k3, v3)
    with pytest.raises(
        ValueError, match=r"batch sizes differ: .*k \(2, 2, 6, 8\), v \(1, 2, 6, 8\)"
    ):
        attention(q, k, v[:1])
    with pytest.raises(ValueError, match=r"batch sizes differ"):
        explain(q, k[:1], v)


def test_head_dims_of_q_and_k_differ(q, k, v) -> None:
    with pytest.raises(ValueError, match=r"q has head dim 8 but k has 4"):
        attention(q, k[..., :4], v)


def test_value_head_dim_may_differ(q, k) -> None:
    v = torch.randn(B, G, S, 3)
    assert attention(q, k, v).shape == (B, H, T, 3)


@pytest.mark.parametrize(
    "v_shape", [(B, G, S - 1, D), (B, 1, S, D)], ids=["keys differ", "heads differ"]
)
def test_k_and_v_disagree_on_heads_or_length(q, k, v_shape) -> None:
    with pytest.raises(ValueError, match=r"k \(2, 2, 6, 8\) and v \(.*\) must agree on \(G, S\)"):
        attention(q, k, torch.randn(v_shape))


@pytest.mark.parametrize("kv_heads", [3, 0])
def test_kv_heads_must_divide_query_heads(q, kv_heads) -> None:
    kv = torch.randn(B, kv_heads, S, D)
    with pytest.raises(
        ValueError, match=rf"key has {kv_heads} heads, which does not divide the 4 query heads"
    ):
        attention(q, kv, kv)


def test_explain_checks_its_input_too(q, k, v) -> None:
    with pytest.raises(ValueError, match="does not divide"):
        explain(q, torch.randn(B, 3, S, D), torch.randn(B, 3, S, D))


# --- mask -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(T, S + 1), (3, T, S), (B + 1, 1, 1, S), (1, H + 1, T, S)], ids=str
)
def test_mask_that_does_not_broadcast(q, k, v, shape) -> None:
    bad = torch.ones(shape, dtype=torch.bool)
    message = f"mask of shape {tuple(shape)} does not broadcast to the (B, H, T, S) = (2, 4, 5, 6)"
    with pytest.raises(ValueError, match=re.escape(message)):
        attention(q, k, v, bad)


def test_mask_with_too_many_dims(q, k, v) -> None:
    with pytest.raises(ValueError, match=r"mask tensor must have 1 to 4 dims"):
        attention(q, k, v, torch.ones(1, 1, 1, T, S, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8], ids=str)
def test_mask_tensor_must_be_bool(q, k, v, dtype) -> None:
    with pytest.raises(TypeError, match=rf"mask tensor must be bool .*got dtype {dtype}"):
        attention(q, k, v, torch.ones(T, S, dtype=dtype))


def test_float_mask_points_to_bias(q, k, v) -> None:
    with pytest.raises(TypeError, match="pass an additive float mask as `bias`"):
        attention(q, k, v, torch.zeros(T, S))


def test_mask_of_another_type(q, k, v) -> None:
    with pytest.raises(
        TypeError, match=r"mask must be a dikkat Mask, a bool tensor or None, got list"
    ):
        attention(q, k, v, [[True] * S] * T)


def test_dense_mask_rows_must_start_at_the_queries(q, k, v) -> None:
    rows = torch.ones(T, S, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"dense mask rows start at query position 0, but the queries start at 1"
    ):
        attention(q, k, v, masks.causal() & rows, q_offset=1)
    # a mask with one row broadcasts over the queries wherever they sit
    attention(q, k, v, masks.causal() & torch.ones(S, dtype=torch.bool), q_offset=1)


@pytest.mark.parametrize("window", [0, -3])
def test_sliding_window_must_be_positive(window) -> None:
    with pytest.raises(ValueError, match=rf"window must be positive, got {window}"):
        masks.sliding_window(window)


@pytest.mark.parametrize("window", [2.5, True, "3", None], ids=repr)
def test_sliding_window_must_be_an_int(window) -> None:
    with pytest.raises(TypeError, match=r"window must be an int"):
        masks.sliding_window(window)


@pytest.mark.parametrize("ahead", [-1, -5])
def test_sliding_window_ahead_must_be_non_negative(ahead) -> None:
    with pytest.raises(ValueError, match=rf"ahead must be non-negative .*got {ahead}"):
        masks.sliding_window(3, ahead=ahead)


@pytest.mark.parametrize("ahead", [1.5, True, "1", None], ids=repr)
def test_sliding_window_ahead_must_be_an_int(ahead) -> None:
    with pytest.raises(TypeError, match=r"ahead must be an int"):
        masks.sliding_window(3, ahead=ahead)


@pytest.mark.parametrize(
    "mask",
    [masks.document(torch.zeros(S, dtype=torch.long)), masks.prefix_lm(2)],
    ids=["document", "prefix_lm"],
)
def test_masks_that_place_queries_in_the_sequence_refuse_a_negative_q_offset(q, k, v, mask):
    with pytest.raises(ValueError, match=r"needs q_offset ≥ 0 .*got q_offset=-1"):
        attention(q, k, v, mask, q_offset=-1)
    with pytest.raises(ValueError, match=r"needs q_offset ≥ 0"):
        attention(q, k, v, masks.causal() & mask, q_offset=-2)  # inside a combination too


def test_padding_lengths_must_match_the_batch(q, k, v) -> None:
    with pytest.raises(ValueError, match=r"padding lengths has 3 entries but the batch has B=2"):
        attention(q, k, v, masks.padding(torch.tensor([1, 2, 3])))


def test_padding_valid_must_match_batch_and_keys(q, k, v) -> None:
    with pytest.raises(ValueError, match=r"padding valid has 3 entries but the batch has B=2"):
        attention(q, k, v, masks.padding(valid=torch.ones(3, S, dtype=torch.bool)))
    with pytest.raises(
        ValueError, match=r"padding valid has shape \(2, 5\) but there are S=6 keys"
    ):
        attention(q, k, v, masks.padding(valid=torch.ones(B, S - 1, dtype=torch.bool)))


def test_padding_arguments() -> None:
    with pytest.raises(ValueError, match=r"exactly one of `lengths` and `valid`"):
        masks.padding()
    with pytest.raises(ValueError, match=r"exactly one of `lengths` and `valid`"):
        masks.padding(torch.tensor([1]), valid=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"lengths must hold integers, got dtype torch.float32"):
        masks.padding(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\), got \(2, 1\)"):
        masks.padding(torch.tensor([[1], [2]]))
    with pytest.raises(TypeError, match=r"valid must be a bool tensor"):
        masks.padding(valid=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"valid must have shape \(B, S\), got \(6,\)"):
        masks.padding(valid=torch.ones(6, dtype=torch.bool))


def test_document_ids(q, k, v) -> None:
    with pytest.raises(
        TypeError, match=r"ids must hold integer document ids, got dtype torch.float32"
    ):
        masks.document(torch.zeros(S))
    with pytest.raises(TypeError, match=r"ids must be a tensor, got list"):
        masks.document([0, 0, 1])
    with pytest.raises(
        ValueError, match=r"ids must have shape \(N,\) or \(B, N\), got \(1, 2, 6\)"
    ):
        masks.document(torch.zeros(1, 2, S, dtype=torch.long))
    with pytest.raises(ValueError, match=r"document ids has 3 entries but the batch has B=2"):
        attention(q, k, v, masks.document(torch.zeros(3, S, dtype=torch.long)))
    with pytest.raises(
        ValueError, match=r"document ids cover 6 positions but queries reach position 6"
    ):
        attention(q, k, v, masks.document(torch.zeros(S, dtype=torch.long)), q_offset=2)


def test_prefix_lm_arguments(q, k, v) -> None:
    with pytest.raises(ValueError, match=r"prefix_len must be non-negative, got \[-1\]"):
        masks.prefix_lm(-1)
    with pytest.raises(TypeError, match=r"prefix_len must be an int or a tensor, got float"):
        masks.prefix_lm(2.0)
    with pytest.raises(ValueError, match=r"prefix_len has 3 entries but the batch has B=2"):
        attention(q, k, v, masks.prefix_lm(torch.tensor([1, 2, 3])))


# --- scale, dropout, bias, q_offset ---------------------------------------------------------------


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")], ids=repr)
def test_scale_must_be_finite(q, k, v, scale) -> None:
    with pytest.raises(ValueError, match=r"scale must be finite, got"):
        attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [0, 0.0, -1, -0.5], ids=repr)
def test_a_zero_or_negative_scale_is_the_formula(q, k, v, scale) -> None:
    """torch takes any float scale; so does dikkat, on every exact backend alike."""
    want = reference_attention(q.double(), k.double(), v.double(), scale=float(scale))[0]
    for backend in ("reference", "sdpa", "tiled"):
        got = attention(q, k, v, scale=scale, backend=backend)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", ["0.1", torch.tensor(0.1), True], ids=repr)
def test_scale_must_be_a_number(q, k, v, scale) -> None:
    with pytest.raises(TypeError, match=r"scale must be a float or None"):
        attention(q, k, v, scale=scale)


@pytest.mark.parametrize("dropout", [-0.1, 1.5, float("nan")], ids=repr)
def test_dropout_must_be_a_probability(q, k, v, dropout) -> None:
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\], got"):
        attention(q, k, v, dropout=dropout)


def test_dropout_one_drops_every_weight(q, k, v) -> None:
    assert not attention(q, k, v, dropout=1.0, backend="reference").any()


def test_dropout_must_be_a_number(q, k, v) -> None:
    with pytest.raises(TypeError, match=r"dropout must be a float"):
        attention(q, k, v, dropout="0.1")


@pytest.mark.parametrize(
    "shape", [(T, S - 1), (1, 1, T + 1, S), (H + 1, 1, 1), (1, B, H, T, S)], ids=str
)
def test_bias_that_does_not_broadcast(q, k, v, shape) -> None:
    with pytest.raises(
        ValueError,
        match=r"bias of shape \(.*\) does not broadcast to the \(B, H, T, S\) = \(2, 4, 5, 6\)",
    ):
        attention(q, k, v, bias=torch.zeros(shape))


def test_bias_must_be_a_float_tensor(q, k, v) -> None:
    with pytest.raises(TypeError, match=r"bias must be a float tensor, got dtype torch.int64"):
        attention(q, k, v, bias=torch.zeros(T, S, dtype=torch.long))
    with pytest.raises(TypeError, match=r"bias must be a tensor or None, got float"):
        attention(q, k, v, bias=0.0)


@pytest.mark.parametrize("q_offset", [1.5, True, "2"], ids=repr)
def test_q_offset_must_be_an_int(q, k, v, q_offset) -> None:
    with pytest.raises(ValueError, match=r"q_offset must be an int .*, got"):
        attention(q, k, v, masks.causal(), q_offset=q_offset)


# --- combining masks, and masks without values ---------------------------------------------------


NOT_MASKS = {
    "None": (None, "NoneType"),
    "numpy": (np.ones((T, S), dtype=bool), "numpy.ndarray"),
    "bool": (True, "bool"),
    "list": ([1], "list"),
}


@pytest.mark.parametrize("op", ["&", "|"])
@pytest.mark.parametrize("kind", NOT_MASKS)
def test_a_mask_combines_only_with_masks_and_bool_tensors(op, kind) -> None:
    # `causal() & None` once built a mask that failed deep inside torch when evaluated, and
    # `np.ones(...) & causal()` went element by element, naming a numpy bool
    other, named = NOT_MASKS[kind]
    message = rf"the other operand of `\{op}` with a mask must be a dikkat Mask or a bool tensor"
    apply = (lambda a, b: a & b) if op == "&" else (lambda a, b: a | b)
    with pytest.raises(TypeError, match=rf"{message}, got {named}"):
        apply(masks.causal(), other)
    with pytest.raises(TypeError, match=rf"{message}, got {named}"):
        apply(other, masks.causal())


def test_a_numpy_mask_points_to_torch_from_numpy(q, k, v) -> None:
    with pytest.raises(TypeError, match=r"got numpy.ndarray \(torch.from_numpy converts"):
        attention(q, k, v, np.ones((T, S), dtype=bool))
    with pytest.raises(TypeError, match=r"got numpy.ndarray \(torch.from_numpy converts"):
        masks.causal() & np.ones((T, S), dtype=bool)


def test_combinators_take_masks_only() -> None:
    with pytest.raises(TypeError, match=r"And combines dikkat Masks, got NoneType"):
        masks.And(masks.causal(), None)
    with pytest.raises(TypeError, match=r"Not combines dikkat Masks, got Tensor"):
        masks.Not(torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("lengths", [torch.tensor([3, -1]), -2], ids=["tensor", "int"])
def test_padding_lengths_must_be_non_negative(lengths) -> None:
    # a negative length once masked every key silently, like a length of 0
    with pytest.raises(ValueError, match=r"lengths must be non-negative, got \[(3, )?-(1|2)\]"):
        masks.padding(lengths)


def test_padding_valid_names_what_it_got() -> None:
    with pytest.raises(TypeError, match=r"valid must be a bool tensor .*got dtype torch.int64"):
        masks.padding(valid=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"valid must be a bool tensor .*got list"):
        masks.padding(valid=[[True]])


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda t: masks.padding(t.long()), "lengths"),
        (lambda t: masks.padding(valid=t.bool().view(1, -1)), "valid"),
        (lambda t: masks.prefix_lm(t.long()), "prefix_len"),
        (lambda t: masks.document(t.long()), "ids"),
        (lambda t: masks.dense(t.bool()), "mask tensor"),
    ],
    ids=["padding", "padding_valid", "prefix_lm", "document", "dense"],
)
def test_masks_refuse_meta_tensors(make, name) -> None:
    # a meta tensor holds no values: it once failed deep inside torch ("Cannot copy out of meta
    # tensor") when the mask was evaluated
    with pytest.raises(ValueError, match=rf"{name} is on the meta device, which holds no values"):
        make(torch.ones(2, device="meta"))


def test_a_meta_mask_tensor_is_refused_by_attention(q, k, v) -> None:
    with pytest.raises(ValueError, match=r"mask tensor is on the meta device"):
        attention(q, k, v, torch.ones(T, S, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("q_offset, error", [(1.5, TypeError), ("1", TypeError), (True, TypeError)])
def test_dense_mask_q_offset(q_offset, error) -> None:
    with pytest.raises(error, match=r"q_offset must be"):
        masks.dense(torch.ones(T, S, dtype=torch.bool), q_offset=q_offset)


# --- from_torch_mask ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[[True]], np.zeros((T, S), dtype=bool), 0.0], ids=repr)
def test_from_torch_mask_takes_tensors(bad) -> None:
    # a list once raised AttributeError: 'list' object has no attribute 'dtype'
    with pytest.raises(TypeError, match=r"attn_mask must be a torch.Tensor or None, got"):
        masks.from_torch_mask(bad)
    with pytest.raises(TypeError, match=r"key_padding_mask must be a torch.Tensor or None, got"):
        masks.from_torch_mask(key_padding_mask=bad)


@pytest.mark.parametrize(
    "n_heads, error, message",
    [
        (0, ValueError, r"n_heads must be positive, got 0"),
        (-2, ValueError, r"n_heads must be positive, got -2"),
        ("2", TypeError, r"n_heads must be an int or None, got str"),
    ],
)
def test_from_torch_mask_n_heads(n_heads, error, message) -> None:
    # n_heads=0 once raised ZeroDivisionError
    with pytest.raises(error, match=message):
        masks.from_torch_mask(torch.zeros(4, T, S, dtype=torch.bool), n_heads=n_heads)


def test_from_torch_mask_refuses_meta_tensors() -> None:
    with pytest.raises(ValueError, match=r"attn_mask is on the meta device"):
        masks.from_torch_mask(torch.zeros(T, S, dtype=torch.bool, device="meta"))


# --- register_backend -----------------------------------------------------------------------------


def _backend(name="custom") -> Backend:
    return Backend(name, lambda r: (r.q, None, None), lambda r: None, "a test backend")


@pytest.mark.parametrize("bad", ["reference", None, object()], ids=["a name", "None", "an object"])
def test_register_backend_takes_a_backend(bad) -> None:
    # a str once raised AttributeError: 'str' object has no attribute 'name'
    with pytest.raises(TypeError, match=r"backend must be a dikkat Backend\(name, run, supports"):
        register_backend(bad)


@pytest.mark.parametrize("name", [3, "", None], ids=repr)
def test_register_backend_name_must_be_a_string(name) -> None:
    with pytest.raises(TypeError, match=r"backend name must be a non-empty str, got"):
        register_backend(_backend(name))
    assert name not in available_backends()


def test_register_backend_name_auto_is_taken() -> None:
    with pytest.raises(ValueError, match=r"backend name 'auto' is taken"):
        register_backend(_backend("auto"))


def test_register_backend_parts_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"backend 'custom': run must be callable, got str"):
        register_backend(Backend("custom", "run", lambda r: None, "doc"))
    with pytest.raises(TypeError, match=r"backend 'custom': avoid must be callable or None"):
        register_backend(Backend("custom", lambda r: None, lambda r: None, "doc", avoid=1))


@pytest.mark.parametrize(
    "rank, error, message",
    [
        ("1", TypeError, r"auto_rank must be an int or None, got str"),
        (True, TypeError, r"auto_rank must be an int or None, got bool"),
        (-1, ValueError, r"auto_rank must be non-negative \(0 = auto's first choice\), got -1"),
    ],
    ids=repr,
)
def test_register_backend_auto_rank(rank, error, message) -> None:
    # -1 once slipped the backend in before the reference, silently; "1" raised deep in list
    with pytest.raises(error, match=message):
        register_backend(_backend(), auto_rank=rank)
    assert "custom" not in available_backends()
