"""Every number docs/contract.md states, reproduced by computation (docs/contract.md §1–§4, §13).

The stated values appear here only as the claim under test, rounded as the contract rounds.
"""

import math

import pytest
import torch

import dikkat
from dikkat.seeds import causal_exercise, scaling_experiment, torch_mha_facts, worked_example


def rounded(t: torch.Tensor, digits: int = 2) -> list[float]:
    return [round(float(x), digits) for x in t]


def test_s1_weights_are_a_distribution_and_output_a_weighted_mean():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out, (w, _) = dikkat.attention(q, k, v, backend="reference", return_weights=True)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 6, dtype=torch.float64))
    # o_i = Σ_j α_ij v_j, written out as a loop over keys
    manual = sum(w[..., j : j + 1] * v[:, :, j : j + 1, :] for j in range(6))
    torch.testing.assert_close(out, manual)
    # and the weights are softmax(q·k/√d_k) computed entry by entry
    i, j = 4, 2
    scores = torch.stack([q[0, 1, i] @ k[0, 1, m] / math.sqrt(8) for m in range(6)])
    torch.testing.assert_close(w[0, 1, i, j], torch.softmax(scores, 0)[j])


def test_s2_worked_example():
    ex = worked_example()
    # A: scores (0.707, 0) → weights (0.67, 0.33), o_A ≈ [0.67, 0.33]
    assert rounded(ex.scores[0], 3) == [0.707, 0.0]
    assert rounded(ex.weights[0]) == [0.67, 0.33]
    assert rounded(ex.outputs[0]) == [0.67, 0.33]
    # the worked example's arithmetic: e^0.707 ≈ 2.03, total ≈ 3.03
    assert round(math.exp(ex.scores[0, 0].item()), 2) == 2.03
    # B: scores (0.141, 0.707) → weights (0.36, 0.64); o_B is closer to B's value [0, 1]
    assert rounded(ex.scores[1], 3) == [0.141, 0.707]
    assert rounded(ex.weights[1]) == [0.36, 0.64]
    assert ex.outputs[1, 1] > ex.outputs[1, 0]


def test_s3_unscaled_softmax_is_nearly_one_hot_at_dk_64():
    s = scaling_experiment(d_k=64, n_keys=64, seed=0)
    assert s.max_weight_unscaled > 0.7  # nearly one-hot (≈ 0.8)
    assert s.max_weight_scaled < 0.2  # spread out (≈ 0.1)
    # the variance of q·k grows like d_k; dividing by √d_k brings it back to ≈ 1
    assert 0.8 * 64 < s.score_var_unscaled < 1.2 * 64
    assert 0.8 < s.score_var_scaled < 1.2
    assert s.entropy_unscaled < s.entropy_scaled < math.log(64)


@pytest.mark.parametrize("d_k", [4, 16, 64, 256])
def test_s3_sharpness_grows_with_dk_only_without_scaling(d_k):
    s = scaling_experiment(d_k=d_k, n_keys=64, rows=1024, seed=0)
    assert s.score_var_unscaled == pytest.approx(d_k, rel=0.25)
    assert s.score_var_scaled == pytest.approx(1.0, rel=0.25)


def test_s4_three_token_causal_mask_blocks_exactly_the_upper_triangle():
    blocked = causal_exercise(3)
    expected = [[j > i for j in range(3)] for i in range(3)]
    assert blocked.tolist() == expected
    # and through attention: −∞ scores get weight exactly 0
    q = k = v = torch.randn(1, 1, 3, 4)
    _, (w, _) = dikkat.attention(q, k, v, dikkat.masks.causal(), return_weights=True)
    assert (w[0, 0][blocked] == 0).all()
    assert w[0, 0, 0, 0] == 1.0


def test_s13_the_seed_script_through_from_torch():
    f = torch_mha_facts()
    assert f.weights_shape == (1, 5, 5)
    assert f.shuffle_equal is True
    assert f.max_output_diff < 1e-6
    w = f.causal_weights_ours
    torch.testing.assert_close(w, f.causal_weights_torch, atol=1e-6, rtol=0)
    assert torch.equal(w, torch.tril(w))  # zeros above the diagonal, exactly
    assert rounded(w[0]) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert rounded(w[1, :2]) == [0.31, 0.69]  # the stated second row
