"""dikkat.audit.windows: every layer of a decoder reads exactly its window, found by cutting the
inputs of each attention layer; a layer that reads too far, or not far enough, is named."""

from __future__ import annotations

import pytest
import torch

import dikkat
from dikkat import masks
from dikkat.models import Decoder, DecoderConfig
from dikkat.models.decoder import gemma3_layer_kinds

CONFIG = DecoderConfig(
    family="gemma3", vocab_size=50, max_len=64, d_model=32, n_layers=6, n_heads=4, n_kv_heads=1,
    head_dim=8, d_ff=40, activation="gelu_tanh", sliding_window=6,
    layer_kinds=gemma3_layer_kinds(6), qk_norm=True, sandwich_norm=True, embed_scale=True,
)  # fmt: skip


@pytest.fixture
def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(CONFIG).eval()


def test_a_correct_decoder_reads_exactly_its_windows(model):
    report = dikkat.audit.windows(model, queries=8, cuts=3)
    assert report.ok, report
    assert [lw.window for lw in report.layers] == [6, 6, 6, 6, 6, None]
    assert "5 sliding layers read exactly their last [6] keys, 1 full layers" in report.summary()
    assert model.tok_emb.weight.dtype == torch.float32  # the audit ran on a copy


@pytest.mark.parametrize(
    ("actual", "word"),
    [(masks.causal(), "read a key before its window"), (masks.sliding_window(3), "did not read")],
)
def test_a_layer_that_reads_another_window_is_named(model, actual, word):
    def wrong_mask(module, args, kwargs):  # layer 2 attends with another mask than declared
        return (args[0], args[1], actual, *args[3:]), kwargs

    model.blocks[2].attn.register_forward_pre_hook(wrong_mask, with_kwargs=True)
    report = dikkat.audit.windows(model, queries=8, cuts=2)
    assert not report.ok
    assert report.summary().startswith("LEAK in layer 2") and word in report.summary()
    assert [lw.layer for lw in report.layers if lw.leaked or lw.blind] == [2]


def test_a_model_without_windows_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="no sliding-window layer"):
        dikkat.audit.windows(Decoder(DecoderConfig()))
