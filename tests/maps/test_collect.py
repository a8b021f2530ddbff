"""dikkat.maps: the captured maps are the model's own weights, filtered and labelled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dikkat import maps
from dikkat.masks import causal
from dikkat.models import BERT, GPT, BERTConfig, GPTConfig, Seq2Seq, Seq2SeqConfig
from dikkat.text import ByteTokenizer, NumberTokenizer
from dikkat.vision.vit import ViT, ViTConfig

SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 2}


def _gpt(**change: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", **{**SMALL, "max_len": 64, **change})).double().eval()


def _gpt_weights(model: GPT, ids: list[int]) -> np.ndarray:
    """Each layer's (H, T, T) weights through the blocks' own return_weights path."""
    x = model.tok_emb(torch.tensor([ids]))
    if model.pos_emb is not None:
        x = model.pos_emb(x)
    out = []
    with torch.no_grad():
        for block in model.blocks:
            x, w = block(x, causal(), return_weights=True)
            out.append(w.self_attn[0])
    return torch.stack(out).numpy()


def test_gpt_maps_equal_the_blocks_own_weights():
    model = _gpt()
    tm = maps.text_model(model, ByteTokenizer())
    m = maps.text_maps(tm, "attend!")
    expected = _gpt_weights(model, list(b"attend!"))
    assert m.weights.shape == expected.shape == (2, 2, 7, 7)
    np.testing.assert_allclose(m.weights, expected, rtol=0, atol=1e-6)
    assert np.triu(m.weights[0, 0], 1).max() == 0  # causal: nothing above the diagonal
    assert m.keys == m.queries == ("a", "t", "t", "e", "n", "d", "!")
    assert m.layers == ("layer 0", "layer 1") and m.heads == (0, 1) and m.kind == "self"


def test_bert_maps_equal_encode_return_weights():
    torch.manual_seed(0)
    model = BERT(BERTConfig.preset("tiny", **SMALL)).double().eval()
    m = maps.text_maps(maps.text_model(model, ByteTokenizer()), "a cat")
    with torch.no_grad():
        _, weights = model.encode(torch.tensor([list(b"a cat")]), return_weights=True)
    expected = torch.stack([w[0] for w in weights]).numpy()
    np.testing.assert_allclose(m.weights, expected, rtol=0, atol=1e-6)
    assert m.keys[1] == "␣"


def test_filters_keep_the_chosen_layers_heads_and_rows():
    model = _gpt(n_layers=3)
    tm = maps.text_model(model, ByteTokenizer())
    full = maps.text_maps(tm, "abcdef")
    part = maps.text_maps(tm, "abcdef", layers=[-1, 0], heads=1, rows=[-1, 1])
    assert part.layers == ("layer 0", "layer 2") and part.heads == (1,)
    # layers in the model's order; rows in the order asked for
    assert part.rows == (5, 1) and part.queries == ("f", "b") and part.keys == full.keys
    np.testing.assert_array_equal(part.weights, full.weights[[0, 2]][:, [1]][:, :, [5, 1]])
    with pytest.raises(ValueError, match="layers \\[3\\] do not exist"):
        maps.text_maps(tm, "abc", layers=[3])


def test_a_long_input_captures_only_the_row_asked_for():
    model = _gpt(max_len=2048).float()
    tm = maps.text_model(model, ByteTokenizer())
    text = "x" * 2048
    with torch.no_grad():
        m = maps.text_maps(tm, text, rows=[-1])
    assert m.weights.shape == (2, 2, 1, 2048)  # a row of 2048 weights per head, not 2048²
    assert m.rows == (2047,) and m.weights.nbytes == 2 * 2 * 2048 * 4
    np.testing.assert_allclose(m.weights.sum(-1), 1.0, atol=1e-5)


def test_translation_maps_are_the_decoders_cross_attention():
    torch.manual_seed(0)
    sizes = {"d_model": 16, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 2}
    cfg = Seq2SeqConfig.preset("tiny", **sizes, src_vocab_size=45, tgt_vocab_size=45)
    model = Seq2Seq(cfg).double().eval()
    t = maps.Translation(source=(8, 11, 6), produced=(20, 30, 2), bos_id=1)
    m = maps.translation_maps(model, NumberTokenizer(), t)
    with torch.no_grad():
        memory = model.encode(torch.tensor([t.source]))
        _, weights = model.decode(torch.tensor([t.decoder_input]), memory, return_weights=True)
    expected = torch.stack([w.cross_attn[0] for w in weights]).numpy()
    assert m.kind == "cross" and m.weights.shape == (2, 2, 3, 3)
    np.testing.assert_allclose(m.weights, expected, rtol=0, atol=1e-6)
    assert m.keys == ("4", "7", "2") and m.queries[-1] == "<eos>"
    assert t.decoder_input == (1, 20, 30)


def test_vit_maps_are_the_class_tokens_row():
    torch.manual_seed(0)
    model = ViT(ViTConfig.preset("tiny", n_layers=2)).eval()
    image = torch.rand(1, 8, 8)
    m = maps.vit_maps(model, image)
    expected = model.attention_maps(image[None]).weights[:, 0]  # (L, H, T): the reference path
    assert m.kind == "image" and m.queries == ("[CLS]",) and m.keys[1] == "(0,0)"
    np.testing.assert_allclose(m.weights[:, :, 0], expected.numpy(), rtol=0, atol=1e-5)


def test_find_token_and_labels():
    tokens = ("[CLS]", "the", "##ing", "Ġit", "[SEP]")
    assert maps.find_token(tokens, "the") == 1
    assert maps.find_token(tokens, "ing") == 2 and maps.find_token(tokens, "It") == 3
    assert maps.find_token(tokens, -1) == 4
    with pytest.raises(ValueError, match="not among the 5 tokens"):
        maps.find_token(tokens, "cat")
    with pytest.raises(ValueError, match="out of range"):
        maps.find_token(tokens, 5)
    assert maps.token_labels(ByteTokenizer(), [104, 32, 10, 200]) == ("h", "␣", "\\n", "\\xc8")
    assert maps.token_labels(NumberTokenizer(), [1, 4]) == ("<bos>", "0")
