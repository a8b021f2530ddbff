"""A local Hugging Face folder, read through dikkat's attention: its maps are eager's weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "it", "was", "tired"]


def _bert_folder(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    transformers.logging.set_verbosity_error()
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(path / "tokenizer.json"))
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)


def test_hf_encoder_maps_equal_eager_weights(tmp_path):
    from dikkat import maps

    _bert_folder(tmp_path)
    tm = maps.hf_model(tmp_path)
    assert not tm.causal and tm.mask_id == 4
    m = maps.text_maps(tm, "the cat sat it was tired")
    assert m.queries == ("[CLS]", "the", "cat", "sat", "it", "was", "tired", "[SEP]")
    eager = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 3]])
    with torch.no_grad():
        attentions = eager(input_ids=ids, output_attentions=True).attentions
    expected = torch.stack([a[0] for a in attentions]).numpy()
    np.testing.assert_allclose(m.weights, expected, rtol=0, atol=1e-5)
    result = maps.text_faithfulness(tm, "the cat sat it was tired", "it")
    assert result.position == 4 and len(result.importance["leave-one-out"]) == 8


def test_a_folder_without_config_is_refused(tmp_path):
    from dikkat import maps

    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        maps.hf_model(tmp_path)
