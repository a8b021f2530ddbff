"""A GPT decode step under torch.compile(fullgraph=True): no graph break, eager's logits, and
the input checks that read values (token ids, positions) still refuse bad ones there."""

from __future__ import annotations

import warnings

import pytest
import torch

from dikkat import GPT, GPTConfig


@pytest.fixture
def step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, max_len=32, d_model=32, n_heads=4, n_layers=2)).eval()
    ids = torch.randint(0, 50, (1, 9))
    cache = model.new_cache(1, 9)
    with torch.no_grad():
        model(ids[:, :8], cache=cache)

    def decode(token: torch.Tensor) -> torch.Tensor:
        return model(token, offset=8, cache=cache, last_only=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield decode, ids[:, 8:]


@torch.no_grad()
def test_a_decode_step_compiles_as_one_graph_to_eager_logits(step) -> None:
    decode, token = step
    want = decode(token)
    got = torch.compile(decode, fullgraph=True, backend="aot_eager")(token)
    torch.testing.assert_close(got, want)


@torch.no_grad()
def test_an_id_outside_the_vocabulary_is_refused_when_compiled(step) -> None:
    decode, token = step
    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    compiled(token)
    with pytest.raises(RuntimeError, match="ids outside the vocabulary of 50"):
        compiled(torch.tensor([[50]]))
