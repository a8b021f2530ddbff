"""Logits that hold NaN or infinity stop the decoding with NonFiniteLogitsError instead of
becoming a token (argmax takes a NaN as the largest: token 0, or an EOS, and an empty answer).

The models are tiny, with a NaN or an infinity written into a weight; the loop's own logits are
made by hand where the step at which they turn bad matters.
"""

from __future__ import annotations

import math

import pytest
import torch

from dikkat.generation import (
    NonFiniteLogitsError,
    SamplingParams,
    generate,
    inference_model,
    iter_generate,
    lookup_generate,
    prefill,
    sample_loop,
)
from dikkat.models import GPT, Decoder, DecoderConfig, GPTConfig
from dikkat.models.static_step import StaticStep

V = 11


def poisoned_decoder(value: float = math.nan) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=32))
    with torch.no_grad():
        model.norm_f.weight[3] = value  # as a damaged file's output_norm.weight
    return model.eval()


def logits_loop(rows: list[torch.Tensor], params: SamplingParams) -> list[int]:
    """sample_loop over fixed logits: rows[0] first, rows[i + 1] after the i-th token."""
    out = sample_loop(lambda: rows[0][None], lambda token, i: rows[i + 1][None], params)
    return [int(t) for t in out]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_nan_weight_stops_generation_at_its_first_token(temperature):
    model = poisoned_decoder()
    with pytest.raises(NonFiniteLogitsError, match=r"is NaN at step 0 \(new token 1\), row 0"):
        generate(model, [[1, 2, 3]], 4, temperature=temperature, seed=0)
    with pytest.raises(ValueError, match="weights or inputs hold non-finite values"):
        next(iter_generate(model, [[1, 2, 3], [4, 5, 6]], 4))


def test_an_infinite_weight_is_named_too():
    with pytest.raises(NonFiniteLogitsError, match=r"is NaN|is infinite"):
        generate(poisoned_decoder(math.inf), [[1, 2, 3]], 4)


def test_the_step_and_the_rows_are_named():
    good = torch.zeros(V)
    bad = good.clone()
    bad[5] = math.nan
    params = SamplingParams(max_new_tokens=5)
    assert logits_loop([good] * 6, params) == [0] * 5
    with pytest.raises(NonFiniteLogitsError, match=r"NaN at step 2 \(new token 3\)"):
        logits_loop([good, good, bad, good, good], params)
    for row in (torch.full((V,), math.inf), torch.full((V,), -math.inf)):
        with pytest.raises(NonFiniteLogitsError, match="infinite at step 0"):
            logits_loop([row], params)
    batch = torch.zeros(3, V)
    batch[1, 0] = batch[2, 4] = math.nan
    with pytest.raises(NonFiniteLogitsError, match="rows 1, 2:"):
        next(sample_loop(lambda: batch, lambda token, i: batch, params))


def test_a_very_negative_logit_is_not_refused():
    row = torch.zeros(V)
    row[:-1] = -math.inf  # masked out: one token remains
    row[-1] = -1e30
    assert logits_loop([row, row], SamplingParams(max_new_tokens=2)) == [V - 1] * 2


def test_the_static_step_path_is_checked():
    """The compiled decode (compile=True) runs StaticStep, which returns the step's logits:
    the loop checks them as it checks the eager step's (here uncompiled, the same graph's
    math without a minute's compile)."""
    model = inference_model(poisoned_decoder(), None)
    cache = model.new_cache(1, 8)
    ids = torch.tensor([[1, 2, 3]])
    step = StaticStep(model, cache)
    loop = sample_loop(
        lambda: prefill(model, ids, cache).nan_to_num(),  # a finite first token, then NaN
        lambda token, i: step(token, 3 + i),
        SamplingParams(max_new_tokens=4),
    )
    assert next(loop).shape == (1,)
    with pytest.raises(NonFiniteLogitsError, match="at step 1"):
        next(loop)


def test_lookup_decoding_is_checked():
    with pytest.raises(NonFiniteLogitsError, match="at step 0"):
        lookup_generate(poisoned_decoder(), [[1, 2, 3, 1, 2]], 4)


def test_a_gpt_with_a_nan_weight_too():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16)).eval()
    with torch.no_grad():
        model.norm_f.weight[0] = math.nan
    with pytest.raises(NonFiniteLogitsError):
        generate(model, [[1, 2]], 3)
