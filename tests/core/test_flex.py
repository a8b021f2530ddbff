"""The flex backend: every mask kind against the fp64 reference, the block-mask cache, and auto
never paying a compile.

Short calls run flex eagerly (see ``flex_eager_max_cells`` in ``dikkat.core.tuning``), so these
tests stay fast; one test compiles a kernel, on purpose. ``test_backends.py`` runs flex under the
2× error rule too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dikkat
from dikkat import masks
from dikkat.core import cache_sizes, clear_caches, flex, flex_masks, tuning
from dikkat.core.masks import Mask
from helpers import Case, oracle, run

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch.nn.attention.flex_attention") is None,
    reason="torch has no flex_attention",
)

IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3], [0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3]])
MASKS = {
    "none": None,
    "causal": masks.causal(),
    "sliding_window": masks.sliding_window(3),
    "document": masks.document(IDS),
    "prefix_lm": masks.prefix_lm(torch.tensor([2, 6])),
    "padding": masks.padding(torch.tensor([0, 7])),  # sequence 0: every row empty
    "padding_valid": masks.padding(valid=torch.rand(2, 9, generator=torch.manual_seed(1)) < 0.5),
    "dense": torch.rand(2, 1, 6, 9, generator=torch.manual_seed(2)) < 0.6,
    "and": masks.sliding_window(4) & masks.padding(torch.tensor([5, 9])),
    "or_not": masks.prefix_lm(3) | ~masks.causal(),
}


@pytest.mark.parametrize("q_offset", [0, 3])
@pytest.mark.parametrize("mask_name", MASKS)
def test_forward_and_backward_equal_the_fp64_reference(mask_name: str, q_offset: int) -> None:
    # B=2, H=4 query heads on G=2 key/value heads (GQA), Dv ≠ D, and a bias
    case = Case(2, 4, 2, 6, 9, 16, 8, q_offset, MASKS[mask_name], (1, 4, 6, 9), seed=11)
    inputs = case.inputs()
    exact = oracle(case, inputs, torch.float64)
    got = run(case, inputs, torch.float64, "flex")
    for name, x in got.items():
        torch.testing.assert_close(x, getattr(exact, name), atol=1e-10, rtol=1e-10, msg=name)
    empty = case.empty_rows()
    assert (got.out.masked_select(empty) == 0).all()


def test_block_masks_are_cached_per_mask_and_shape() -> None:
    q = k = v = torch.randn(2, 2, 8, 8)
    cache = flex.block_masks
    cache.clear()

    def call(mask: Mask, q_offset: int = 0) -> tuple[int, int]:
        dikkat.attention(q, k, v, mask, q_offset=q_offset, backend="flex")
        return cache.builds, cache.hits

    window = masks.sliding_window(3)
    assert call(window) == (1, 0)
    assert call(window) == (1, 1)  # the same mask: built once
    assert call(masks.sliding_window(3)) == (1, 2)  # equal parameters allow the same pairs
    assert call(masks.sliding_window(4)) == (2, 2)  # another window: rebuilt
    assert call(window, q_offset=1) == (3, 2)  # other rows: rebuilt
    ids = torch.zeros(8, dtype=torch.long)
    docs = masks.document(ids)
    assert call(docs) == (4, 2)
    assert call(masks.document(ids.clone())) == (5, 2)  # other tensors: rebuilt
    ids[4:] = 1  # changed in place: the old block mask would be wrong
    assert call(docs) == (6, 2)
    out = dikkat.attention(q, k, v, docs, backend="flex")
    torch.testing.assert_close(out, dikkat.attention(q, k, v, docs, backend="reference"))


def test_short_explicit_calls_never_compile() -> None:
    flex.compiled.clear()
    q = k = v = torch.randn(1, 2, 16, 8)
    dikkat.attention(q, k, v, masks.sliding_window(4), backend="flex")
    assert len(flex.compiled) == 0


def test_auto_never_picks_a_cold_flex() -> None:
    flex.compiled.clear()
    q = k = v = torch.randn(1, 1, 1024, 8)  # exactly the eager bound: 1 Mi cells
    assert tuning.for_device("cpu").flex_eager_max_cells == 1024 * 1024
    window = masks.sliding_window(16)
    text = dikkat.explain(q, k, v, window)  # SDPA passed by: most cells are masked
    assert text.startswith("tiled (not sdpa:")
    assert "not flex: the call is too short" in text
    assert "Depends on this process" not in text  # too short: no compile would change it
    q = k = v = torch.randn(1, 1, 2048, 8)  # past it: flex would compile
    text = dikkat.explain(q, k, v, window)
    assert text.startswith("tiled (") and "not flex: flex is not yet compiled" in text
    assert text.endswith(
        "Depends on this process: auto takes flex once a call with backend='flex' has compiled "
        "it for this signature."
    )
    assert dikkat.explain(q, k, v, masks.causal()).startswith("sdpa (the first choice)")


def test_a_compiled_kernel_is_exact_and_then_used_by_auto() -> None:
    # One compile (tens of seconds on a small CPU): GQA, a sliding window and rows with no key.
    clear_caches()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 1024, 16, generator=g)
    k, v = (torch.randn(1, 1, 1024, 16, generator=g) for _ in range(2))
    mask = masks.sliding_window(64) & masks.padding(torch.tensor([512]))  # rows ≥ 575: no key
    assert "not yet compiled" in dikkat.explain(q, k, v, mask)
    out = dikkat.attention(q, k, v, mask, backend="flex")
    want = dikkat.attention(q.double(), k.double(), v.double(), mask, backend="reference")
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert (out[:, :, 575:] == 0).all()
    # a new mask object with the same parameters hits the same kernel: auto may now take flex,
    # and explain says that this depends on the compile
    same = masks.sliding_window(64) & masks.padding(torch.tensor([700]))
    text = dikkat.explain(q, k, v, same)
    assert text.startswith("flex (not sdpa:")
    assert "Depends on this process: flex is taken because this process has compiled it" in text
    torch.testing.assert_close(
        dikkat.attention(q, k, v, same), dikkat.attention(q, k, v, same, backend="flex")
    )
    assert not dikkat.explain(q, k, v, masks.sliding_window(32)).startswith("flex")
    assert cache_sizes()["flex compiled signatures"] == 1
    # forgetting the compile (the graph itself stays in torch's cache): auto passes flex by
    clear_caches()
    assert dikkat.explain(q, k, v, same).startswith("tiled (")


class _Threshold(Mask):
    """A mask of the caller's own whose predicate branches on a tensor's value."""

    def predicate(self, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if bool((q_idx > 2).any()) else q_idx >= 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"return_weights": True}, "never holds the full weights"),
        ({"dropout": 0.1}, "no dropout"),
        ({"return_lse": True}, "on CPU returns no log-sum-exp"),
    ],
)
def test_unsupported_requests_say_why(kwargs: dict, match: str) -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=rf"backend 'flex' cannot serve this call: .*{match}"):
        dikkat.attention(q, k, v, masks.causal(), backend="flex", **kwargs)


def test_a_mask_vmap_cannot_run_is_a_clear_error() -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"_Threshold: its predicate must run under torch\.vmap"):
        dikkat.attention(q, k, v, _Threshold(), backend="flex")


def test_torch_without_flex_is_a_reason_not_an_import_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a torch without FlexAttention: the import in flex_masks found none
    monkeypatch.setattr(flex_masks, "_FLEX", None)
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"has no torch.nn.attention.flex_attention"):
        dikkat.attention(q, k, v, backend="flex")
    assert not dikkat.explain(q, k, v, masks.sliding_window(2)).startswith("flex")


def test_a_dynamo_failure_falls_back_to_tiled_without_resetting_dynamo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dynamo has been seen to fail with a TypeError inside torch while explaining a recompile.
    That call then runs on the tiled backend, with a warning; dynamo is never reset (that would
    drop every graph the process has compiled)."""
    api = importlib.import_module("torch.nn.attention.flex_attention")

    def broken(*args, **kwargs):
        raise TypeError("'NoneType' object is not iterable")

    def no_reset() -> None:
        raise AssertionError("dikkat reset dynamo")

    monkeypatch.setattr(api, "flex_attention", broken)
    monkeypatch.setattr(torch._dynamo, "reset", no_reset)
    q = k = v = torch.randn(1, 2, 16, 8)
    window = masks.sliding_window(4)
    with pytest.warns(RuntimeWarning, match=r"dynamo failed .*ran on the tiled backend"):
        out = dikkat.attention(q, k, v, window, backend="flex")
    torch.testing.assert_close(out, dikkat.attention(q, k, v, window, backend="tiled"))

    def other(*args, **kwargs):
        raise TypeError("an error of another kind")

    monkeypatch.setattr(api, "flex_attention", other)
    with pytest.raises(TypeError, match="another kind"):
        dikkat.attention(q, k, v, window, backend="flex")
