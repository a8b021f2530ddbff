"""The faithfulness check: Spearman's ρ, leave-one-out and gradient × input, each against a
direct computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dikkat import maps
from dikkat.models import BERT, GPT, BERTConfig, GPTConfig
from dikkat.text import ByteTokenizer

SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 2}


def test_ranks_average_ties():
    np.testing.assert_array_equal(maps.rank([3.0, 1.0, 2.0, 2.0]), [4.0, 1.0, 2.5, 2.5])
    np.testing.assert_array_equal(maps.rank([5, 5, 5]), [2.0, 2.0, 2.0])


def test_spearman_equals_the_formula_on_ties():
    a = [1.0, 2.0, 2.0, 3.0, 5.0]
    b = [2.0, 1.0, 4.0, 4.0, 3.0]
    ra, rb = np.array([1, 2.5, 2.5, 4, 5]), np.array([2, 1, 4.5, 4.5, 3])  # by hand
    da, db = ra - ra.mean(), rb - rb.mean()
    expected = (da * db).sum() / math.sqrt((da**2).sum() * (db**2).sum())
    assert maps.spearman(a, b) == pytest.approx(expected, abs=1e-15)
    assert expected != pytest.approx(0.0)  # the example is not trivially 0


def test_spearman_edges():
    assert maps.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert maps.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(maps.spearman([1, 1, 1], [1, 2, 3]))  # a constant has no ranking
    assert maps.spearman([1, np.nan, 2, 3], [1, 5, 2, 3]) == pytest.approx(1.0)  # NaN dropped
    with pytest.raises(ValueError, match="one length"):
        maps.spearman([1, 2], [1, 2, 3])


@pytest.fixture(scope="module")
def gpt() -> maps.TextModel:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", **SMALL, max_len=64)).double().eval()
    return maps.text_model(model, ByteTokenizer())


def test_gpt_leave_one_out_and_gradient_are_the_direct_ones(gpt):
    text, focus = "abcde", 3  # "d", whose next token is "e"
    result = maps.text_faithfulness(gpt, text, focus)
    assert result.focus == "d" and result.positions == (0, 1, 2, 3)  # what "d" can see
    ids = torch.tensor([list(b"abcde")])
    model = gpt.module
    with torch.no_grad():
        base = model(ids)[0, focus].log_softmax(-1)[ord("e")]
        without_b = torch.tensor([list(b"acd")])
        lp = model(without_b)[0, -1].log_softmax(-1)[ord("e")]
    loo = result.importance["leave-one-out"]
    assert loo[1] == pytest.approx(abs(float(base - lp)), abs=1e-12)
    # gradient × input by hand: the embeddings as a leaf
    emb = model.tok_emb(ids[:, : focus + 1]).detach().requires_grad_(True)
    x = model.pos_emb(emb) if model.pos_emb is not None else emb
    from dikkat.masks import causal

    for block in model.blocks:
        x = block(x, causal())
    logp = model.lm_head(model.norm_f(x))[0, -1].log_softmax(-1)[ord("e")]
    (grad,) = torch.autograd.grad(logp, emb)
    expected = (grad * emb).sum(-1)[0].abs().detach().numpy()
    np.testing.assert_allclose(result.importance["gradient × input"], expected, rtol=1e-9)
    assert all(p.grad is None for p in model.parameters())  # the model is left untouched


def test_the_table_ranks_each_layer_and_the_rollout(gpt):
    result = maps.text_faithfulness(gpt, "hello", -1)
    table = result.table()
    for line in ("layer 0 (mean of heads)", "layer 1 (mean of heads)", "rollout to layer 1"):
        assert line in table
    rho = result.correlations()
    assert set(rho) == set(result.attention)
    name = "layer 1 (mean of heads)"
    expected = maps.spearman(result.attention[name], result.importance["leave-one-out"])
    assert rho[name]["leave-one-out"] == expected
    np.testing.assert_allclose(sum(result.attention[name]), 1.0, atol=1e-6)


def test_an_encoder_masks_each_token_or_removes_it():
    torch.manual_seed(0)
    model = BERT(BERTConfig.preset("tiny", **SMALL, vocab_size=257)).double().eval()
    tm = maps.text_model(model, ByteTokenizer())  # one id past the bytes: the mlm task's [MASK]
    assert tm.mask_id == 256
    result = maps.text_faithfulness(tm, "abc", "b")
    assert "[MASK]" in result.output and result.positions == (0, 1, 2)
    with torch.no_grad():
        h = model.encode(torch.tensor([[97, 98, 99]]))[0, 1]
        h2 = model.encode(torch.tensor([[97, 98, 256]]))[0, 1]
    expected = 1 - torch.nn.functional.cosine_similarity(h, h2, dim=0)
    assert result.importance["leave-one-out"][2] == pytest.approx(float(expected), abs=1e-12)
    bare = maps.text_model(BERT(BERTConfig.preset("tiny", **SMALL)).eval(), ByteTokenizer())
    removed = maps.text_faithfulness(bare, "abc", 1)
    assert "removed" in removed.output
    assert np.isnan(removed.importance["leave-one-out"][1])  # the focus itself cannot go
