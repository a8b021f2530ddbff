"""BERT: shapes, presets, bidirectional attention, padding that is truly ignored (docs/contract.md
§11).

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``H`` heads, ``V`` vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dikkat.models import BERT, BERTConfig
from helpers import scramble

V, C, H = 47, 32, 4


def small(seed: int = 0, **overrides: object) -> BERT:
    torch.manual_seed(seed)
    fields = dict(vocab_size=V, max_len=20, d_model=C, n_layers=2, n_heads=H, type_vocab_size=3)
    fields.update(overrides)
    return scramble(BERT(BERTConfig(**fields)), seed)


def random_ids(B: int, T: int, seed: int, high: int = V) -> Tensor:
    return torch.randint(0, high, (B, T), generator=torch.Generator().manual_seed(seed))


def test_shapes_of_hidden_states_logits_and_weights():
    model = small()
    ids = random_ids(2, 9, seed=1)
    with torch.no_grad():
        hidden = model.encode(ids)
        logits = model(ids)
        hidden_w, weights = model.encode(ids, return_weights=True)
    assert hidden.shape == (2, 9, C)
    assert logits.shape == (2, 9, V)
    assert len(weights) == 2 and all(w.shape == (2, H, 9, 9) for w in weights)
    torch.testing.assert_close(hidden_w, hidden, rtol=0, atol=2e-6)  # another backend
    for w in weights:
        torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 9), rtol=0, atol=1e-5)


def test_mlm_decoder_is_the_token_embedding():
    model = small()
    assert model.mlm.embedding is model.tok_emb
    assert model.mlm.embedding.weight is model.tok_emb.weight


def test_presets():
    base = BERTConfig.preset("bert-base")
    assert (base.n_layers, base.n_heads, base.d_model, base.vocab_size, base.max_len) == (
        12,
        12,
        768,
        30522,
        512,
    )
    assert base.norm_eps == 1e-12 and base.activation == "gelu" and base.mlm_head
    mini = BERTConfig.preset("minilm-l6")
    assert (mini.n_layers, mini.n_heads, mini.d_model, mini.d_ff) == (6, 12, 384, 1536)
    assert not mini.mlm_head
    assert BERTConfig.preset("tiny") == BERTConfig()
    with pytest.raises(ValueError, match="unknown BERT preset"):
        BERTConfig.preset("roberta")


def test_bert_base_parameter_count_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        ours = BERT(BERTConfig.preset("bert-base", mlm_head=False))
        hf = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_without_an_mlm_head_forward_is_an_error():
    model = small(mlm_head=False)
    assert model.mlm is None
    with pytest.raises(ValueError, match="MLM head"):
        model(random_ids(1, 4, seed=0))
    assert model.encode(random_ids(1, 4, seed=0)).shape == (1, 4, C)


def test_bad_inputs_raise():
    model = small()
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        model.encode(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="max_len"):
        model.encode(random_ids(1, 21, seed=0))
    with pytest.raises(ValueError, match="valid"):
        model.encode(random_ids(2, 4, seed=0), torch.ones(2, 5, dtype=torch.bool))


# --- bidirectional, padding ------------------------------------------------------------------


@pytest.mark.parametrize("t", [3, 8])
def test_changing_a_later_token_changes_earlier_hidden_states(t):
    model = small(seed=2)
    ids = random_ids(2, 9, seed=3)
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % V
    with torch.no_grad():
        a, b = model.encode(ids), model.encode(changed)
    # every earlier position sees the later token (an encoder is not causal)
    per_position = (a[:, :t] - b[:, :t]).abs().amax(dim=(0, 2))  # (t,)
    assert bool((per_position > 1e-3).all())


def padded_batch(lengths: tuple[int, ...], T: int, seed: int) -> tuple[Tensor, Tensor]:
    ids = random_ids(len(lengths), T, seed=seed)
    valid = torch.arange(T) < torch.tensor(lengths).unsqueeze(1)  # right padding, (B, T)
    return ids, valid


def test_padding_keys_are_ignored():
    model = small(seed=4)
    lengths, T = (5, 9, 2), 9
    ids, valid = padded_batch(lengths, T, seed=5)
    other = torch.where(valid, ids, (ids + 7) % V)  # every padded token changed
    types = random_ids(3, T, seed=6, high=3)
    with torch.no_grad():
        a = model.encode(ids, valid, types)
        b = model.encode(other, valid, types)
    torch.testing.assert_close(a[valid], b[valid], rtol=0, atol=1e-6)
    # without the mask the padded tokens do leak into the real ones
    with torch.no_grad():
        leak = (model.encode(ids, None, types) - model.encode(other, None, types))[valid]
    assert leak.abs().amax() > 1e-3


def test_a_padded_row_equals_the_unpadded_sequence_alone():
    model = small(seed=7)
    lengths, T = (4, 9, 6), 9
    ids, valid = padded_batch(lengths, T, seed=8)
    types = random_ids(3, T, seed=9, high=3)
    with torch.no_grad():
        batch = model.encode(ids, valid, types)
        batch_logits = model(ids, valid, types)
        for b, n in enumerate(lengths):
            alone = model.encode(ids[b : b + 1, :n], None, types[b : b + 1, :n])[0]
            torch.testing.assert_close(batch[b, :n], alone, rtol=0, atol=1e-5)
            alone_logits = model(ids[b : b + 1, :n], None, types[b : b + 1, :n])[0]
            torch.testing.assert_close(batch_logits[b, :n], alone_logits, rtol=0, atol=1e-5)


def test_padding_gets_zero_attention_weight():
    model = small(seed=10)
    ids, valid = padded_batch((3, 7), 7, seed=11)
    with torch.no_grad():
        _, weights = model.encode(ids, valid, return_weights=True)
    for w in weights:  # (B, H, T, S)
        keys_blocked = ~valid[:, None, None, :].expand_as(w)
        assert bool((w[keys_blocked] == 0).all())


def test_token_types_change_the_output():
    model = small(seed=12)
    ids = random_ids(1, 6, seed=13)
    with torch.no_grad():
        zeros = model.encode(ids)
        explicit_zeros = model.encode(ids, token_type_ids=torch.zeros_like(ids))
        ones = model.encode(ids, token_type_ids=torch.ones_like(ids))
    torch.testing.assert_close(zeros, explicit_zeros, rtol=0, atol=0)
    assert (zeros - ones).abs().amax() > 1e-2
