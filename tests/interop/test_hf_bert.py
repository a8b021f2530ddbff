"""bert_from_hf: Hugging Face BERT weights give HF's hidden states and MLM logits (docs/contract.md
§11).

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``V`` vocabulary.

Hugging Face is the oracle: randomly initialised ``BertModel`` / ``BertForMaskedLM`` built from
small configs (no network), with right padding and token types, compared at the real positions.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dikkat.interop import bert_from_hf
from dikkat.models import BERTConfig
from helpers import scramble

transformers = pytest.importorskip("transformers")

# (vocab, hidden, layers, heads, intermediate, max_positions, type_vocab, activation)
SIZES = [
    (99, 32, 2, 4, 37, 40, 2, "gelu"),
    (64, 48, 3, 6, 96, 24, 3, "gelu"),
    (120, 24, 1, 2, 64, 32, 2, "gelu_new"),
]
IDS = [f"C{s[1]}-L{s[2]}-H{s[3]}-{s[7]}" for s in SIZES]


def hf_config(size: tuple):
    V, C, L, H, F, P, types, act = size
    return transformers.BertConfig(
        vocab_size=V,
        hidden_size=C,
        num_hidden_layers=L,
        num_attention_heads=H,
        intermediate_size=F,
        max_position_embeddings=P,
        type_vocab_size=types,
        hidden_act=act,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def batch(size: tuple, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """ids, attention_mask (right padding, one row unpadded) and token types, all (B, T)."""
    V, P, types = size[0], size[5], size[6]
    g = torch.Generator().manual_seed(seed)
    T = min(P, 17)
    lengths = torch.tensor([T, 5, 11, 1])
    ids = torch.randint(0, V, (4, T), generator=g)
    mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    token_types = torch.randint(0, types, (4, T), generator=g)
    return ids, mask, token_types


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_hidden_states_equal_bert_model(size):
    torch.manual_seed(0)
    hf = scramble(transformers.BertModel(hf_config(size)), seed=1)
    ours = bert_from_hf(hf).eval()
    assert ours.mlm is None
    ids, mask, types = batch(size, seed=2)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = ours.encode(ids, mask.bool(), types)
    real = mask.bool()
    assert expected[real].abs().amax() > 1.0
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_mlm_logits_equal_bert_for_masked_lm(size):
    torch.manual_seed(0)
    hf = scramble(transformers.BertForMaskedLM(hf_config(size)), seed=3)
    ours = bert_from_hf(hf).eval()
    assert ours.mlm is not None
    ids, mask, types = batch(size, seed=4)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        got = ours(ids, mask.bool(), types)
        hidden = hf.bert(input_ids=ids, attention_mask=mask, token_type_ids=types)
        got_hidden = ours.encode(ids, mask.bool(), types)
    real = mask.bool()
    assert expected[real].abs().amax() > 1.0
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_hidden[real], hidden.last_hidden_state[real], rtol=0, atol=1e-5)


def test_from_a_state_dict_and_config():
    size = SIZES[0]
    torch.manual_seed(0)
    hf = scramble(transformers.BertForMaskedLM(hf_config(size)), seed=5)
    ids, mask, types = batch(size, seed=6)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        a = bert_from_hf(hf.state_dict(), hf.config).eval()(ids, mask.bool(), types)
        V, C, L, H, F, P, n_types, _ = size
        cfg = BERTConfig(
            vocab_size=V,
            max_len=P,
            d_model=C,
            n_layers=L,
            n_heads=H,
            d_ff=F,
            type_vocab_size=n_types,
        )
        b = bert_from_hf(hf.state_dict(), cfg).eval()(ids, mask.bool(), types)
    real = mask.bool()
    torch.testing.assert_close(a[real], expected[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(b[real], expected[real], rtol=0, atol=1e-5)


def test_without_token_types_equals_hf_defaults():
    size = SIZES[0]
    torch.manual_seed(0)
    hf = scramble(transformers.BertModel(hf_config(size)), seed=7)
    ours = bert_from_hf(hf).eval()
    ids, _, _ = batch(size, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(
            ours.encode(ids), hf(input_ids=ids).last_hidden_state, rtol=0, atol=1e-5
        )


def test_bad_inputs_are_rejected():
    torch.manual_seed(0)
    hf = transformers.BertModel(hf_config(SIZES[0]))
    with pytest.raises(ValueError, match="config"):
        bert_from_hf(hf.state_dict())
    gpt2 = transformers.GPT2Model(
        transformers.GPT2Config(
            vocab_size=30,
            n_embd=16,
            n_layer=1,
            n_head=2,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    with pytest.raises(ValueError, match="BERT"):
        bert_from_hf(gpt2.state_dict(), hf.config)
    relative = hf_config(SIZES[0])
    relative.position_embedding_type = "relative_key"
    with pytest.raises(ValueError, match="absolute"):
        bert_from_hf(hf.state_dict(), relative)
    wider = hf_config(SIZES[0])
    wider.hidden_size = 64  # same layers, other width
    with pytest.raises(ValueError, match="does not fit the model's config"):
        bert_from_hf(hf.state_dict(), wider)
