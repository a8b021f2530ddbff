"""dikkat.capture: the weights of the layers, heads and rows asked for, recomputed from q, k and
the log-sum-exp, equal the reference softmax's computed in float64.

Notation: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length.

The oracle is ``MultiHeadAttention(..., return_weights=True)`` on the reference backend in
float64 (the softmax written out, holding every weight); the captured layers run in float32 on
the fast backends, which never hold the weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dikkat
from dikkat import masks

TOL = 1e-5
FAST = ["tiled", "sdpa", "auto"]  # sdpa returns no lse: the rows' own is computed


def _layer(backend: str, **extra: object) -> dikkat.MultiHeadAttention:
    torch.manual_seed(0)
    return dikkat.MultiHeadAttention(32, 4, backend=backend, **extra).eval()


def _oracle(layer: nn.Module, x: torch.Tensor, mask: object = None) -> torch.Tensor:
    exact = copy.deepcopy(layer).double()
    exact.backend = "reference"
    return exact(x.double(), mask=mask, return_weights=True)[1]  # (B, H, T, S)


class Wrapper(nn.Module):
    """A model holding two attention layers, the second attending to the first's output."""

    def __init__(self, backend: str, **extra: object) -> None:
        super().__init__()
        self.first, self.second = _layer(backend, **extra), _layer(backend, **extra)

    def forward(self, x: torch.Tensor, mask: object = None) -> torch.Tensor:
        return self.second(self.first(x, mask=mask), mask=mask)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize(
    "extra", [{}, {"n_kv_heads": 2}, {"alibi": dikkat.ALiBi(4)}], ids=["mha", "gqa", "alibi"]
)
def test_captured_rows_equal_the_float64_softmax(backend: str, extra: dict) -> None:
    layer = _layer(backend, **extra)
    x = torch.randn(2, 11, 32)
    mask = masks.causal() & masks.padding(torch.tensor([11, 7]))
    with dikkat.capture(layer, heads=[3, 0], rows=[-1, 0, 5]) as cap:
        out = layer(x, mask=mask)
    w = cap[0]
    assert w.shape == (2, 2, 3, 11) and cap.calls[0].rows == (10, 0, 5)
    full = _oracle(layer, x, mask)
    want = full[:, [3, 0]][:, :, [10, 0, 5]]
    torch.testing.assert_close(w.double(), want, atol=TOL, rtol=0)
    # the capture changes nothing the layer computes
    torch.testing.assert_close(out, layer(x, mask=mask), atol=0, rtol=0)


@pytest.mark.parametrize("backend", FAST)
def test_only_selected_layers_record(backend: str) -> None:
    model = Wrapper(backend)
    x = torch.randn(1, 6, 32)
    assert [name for name, _ in dikkat.attention_layers(model)] == ["first", "second"]
    with dikkat.capture(model, layers=["second"]) as cap:
        model(x, mask=masks.sliding_window(3))
    assert cap.layers == ("second",) and len(cap.calls) == 1
    h = model.first(x, mask=masks.sliding_window(3))
    torch.testing.assert_close(
        cap["second"].double(), _oracle(model.second, h, masks.sliding_window(3)), atol=TOL, rtol=0
    )
    model(x)  # the hooks are gone after the block
    assert len(cap.calls) == 1


def test_generation_records_one_call_per_step() -> None:
    torch.manual_seed(0)
    config = dikkat.GPTConfig(vocab_size=40, max_len=32, d_model=32, n_layers=2, n_heads=4)
    model = dikkat.GPT(config).eval()
    prompt = torch.randint(0, 40, (1, 5))
    with dikkat.capture(model, layers=[-1], heads=[2], rows=[-1]) as cap:
        out = model.generate(prompt, max_new_tokens=4)
    steps = cap.of(-1)
    assert [w.shape[-1] for w in steps] == [5, 6, 7, 8]  # the cache grows by one key a step
    # the last step's weights, recomputed by a plain forward of the whole sequence
    ids = torch.tensor(out[0][:-1]).unsqueeze(0)
    with dikkat.capture(model, layers=[-1], heads=[2], rows=[-1]) as again:
        model(ids)
    torch.testing.assert_close(steps[-1], again[-1], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="called 4 times"):
        cap[-1]


class NotDikkatAttention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ x.transpose(-2, -1), -1) @ x


def test_a_layer_that_never_calls_dikkat_is_an_error() -> None:
    layer = NotDikkatAttention()
    with (
        pytest.raises(ValueError, match=r"ran without calling dikkat\.attention"),
        dikkat.capture(layer),
    ):
        layer(torch.randn(1, 3, 4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"layers": [2]}, ValueError, "out of range for the 1 attention layers"),
        ({"layers": ["nope"]}, ValueError, "no attention layer named 'nope'"),
        ({"layers": [1.5]}, TypeError, "layers must hold ints or names"),
        ({"heads": []}, ValueError, "heads must be a non-empty sequence"),
        ({"rows": "0"}, TypeError, "rows must be an int"),
    ],
)
def test_bad_selections_are_refused_by_name(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match), dikkat.capture(_layer("auto"), **kwargs):
        pass


def test_heads_or_rows_a_call_does_not_have_are_refused() -> None:
    layer = _layer("tiled")
    with (
        pytest.raises(ValueError, match=r"capture rows \[8\] do not all exist in a call with 6"),
        dikkat.capture(layer, rows=[8]),
    ):
        layer(torch.randn(1, 6, 32))
    with pytest.raises(ValueError, match="no attention layers"), dikkat.capture(nn.Linear(2, 2)):
        pass


def test_attention_weights_without_lse_equals_with_it() -> None:
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8)
    v = torch.randn(2, 2, 9, 8)
    bias = torch.randn(1, 4, 9, 1)  # broadcast over the keys: indexed, never expanded
    mask = masks.causal()
    _, (_, lse) = dikkat.attention(q, k, v, mask, bias=bias, return_lse=True, backend="tiled")
    picked = dict(rows=[8, 2], heads=[1], mask=mask, bias=bias)
    with_lse = dikkat.attention_weights(q, k, lse, **picked)
    without = dikkat.attention_weights(q, k, None, **picked)
    torch.testing.assert_close(with_lse, without, atol=TOL, rtol=0)
    _, (full, _) = dikkat.attention(
        q.double(), k.double(), v.double(), mask, bias=bias.double(), return_weights=True
    )
    torch.testing.assert_close(without.double(), full[:, [1]][:, :, [8, 2]], atol=TOL, rtol=0)
