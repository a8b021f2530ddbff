"""dikkat.audit.kv_cache and dikkat.audit.permutation on dikkat's layers and models.

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``V`` vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from audit_models import V, WrongOffsetGPT, gpt

from dikkat import audit, masks
from dikkat.layers import Block, BlockConfig, MultiHeadAttention, RotaryEmbedding
from dikkat.models import GPTConfig

T = 10


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_decoding_through_the_cache_gives_the_full_forward(position):
    report = audit.kv_cache(gpt(position=position), seq_len=T, prefill=3)
    assert report.ok and report.first_bad is None, str(report)
    assert len(report.errors) == T and report.prefill == 3
    assert report.rtol == 1e-4  # float32's
    assert "prefill of 3 then 7 one-token steps" in report.summary()


def test_a_cache_written_one_slot_early_fails_at_the_first_decode_step():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, max_len=32)
    report = audit.kv_cache(WrongOffsetGPT(config).eval(), seq_len=T, prefill=4)
    assert not report.ok
    assert report.first_bad == 4  # the prefill is right, the first step is not
    assert max(report.errors[:4]) <= report.rtol * report.scale
    assert "position 4 (decode step 1)" in str(report)


def test_kv_cache_refuses_what_has_no_cache():
    with pytest.raises(TypeError, match="needs a dikkat causal LM"):
        audit.kv_cache(torch.nn.Embedding(V, 4), vocab_size=V)
    with pytest.raises(ValueError, match="prefill must be an int in"):
        audit.kv_cache(gpt(), seq_len=T, prefill=T)


def test_attention_without_positions_is_permutation_equivariant_with_rope_it_is_not():
    torch.manual_seed(0)
    x = torch.randn(2, T, 16)
    plain = audit.permutation(MultiHeadAttention(16, 2).eval(), x, expect=True)
    assert plain.ok and plain.equivariant, str(plain)
    assert sorted(plain.permutation) == list(range(T)) and plain.permutation != tuple(range(T))
    block = audit.permutation(Block(BlockConfig(d_model=16, n_heads=2)).eval(), x)
    assert block.equivariant and "blind to position" in block.summary()
    rope = MultiHeadAttention(16, 2, rope=RotaryEmbedding(8)).eval()
    rotated = audit.permutation(rope, x, expect=False)
    assert rotated.ok and not rotated.equivariant, str(rotated)
    assert "uses positions" in rotated.summary()


def test_a_causal_model_sees_positions_only_if_it_is_given_them():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).eval()
    x = torch.randn(2, T, 16)
    blind = audit.permutation(lambda h: mha(h, mask=masks.causal()), x, causal=True)
    assert blind.equivariant, str(blind)
    assert blind.permutation[-1] == T - 1  # the last position stays where it is
    ids = torch.randint(0, V, (2, T))
    for position in ("learned", "rope"):
        report = audit.permutation(gpt(position=position), ids, causal=True, expect=False)
        assert report.ok and not report.equivariant, str(report)
    wrong = audit.permutation(gpt(), ids, causal=True, expect=True)
    assert not wrong.ok and "UNEXPECTED" in str(wrong)


def test_permutation_refuses_too_few_positions():
    with pytest.raises(ValueError, match="too few to permute"):
        audit.permutation(gpt(), torch.zeros(1, 2, dtype=torch.long), causal=True)
