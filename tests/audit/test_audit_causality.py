"""dikkat.audit.causality and dikkat.audit.mask: dikkat's models pass on every exact backend,
and models broken on purpose are caught with their first leaking position named.

Notation: ``B`` batch, ``T`` tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from audit_models import OneLayerLM, V, all_pairs, gpt

import dikkat
from dikkat import audit, masks
from dikkat.models import BERT, BERTConfig, Seq2Seq, Seq2SeqConfig

T = 10


@pytest.mark.parametrize("backend", ["reference", "tiled", "sdpa"])
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_a_gpt_is_causal_on_every_exact_backend(backend, position):
    model = gpt(position=position)
    for block in model.blocks:
        block.attn.backend = backend
    report = audit.causality(model, V, T)
    assert report.ok and report.leaks == () and report.first_leak is None, str(report)
    assert report.unread == (), str(report)  # every earlier token reaches every output
    assert report.checked.jacobian.startswith("through tok_emb")
    assert report.checked.seq_len == T and report.checked.trials == 2
    assert "ok" in str(report).splitlines()[0]


def test_a_model_without_a_mask_leaks_from_the_first_position():
    report = audit.causality(OneLayerLM(lambda T: None), V, T)
    assert not report.ok
    assert report.first_leak == (0, 1)
    assert report.leaks == all_pairs(T, lambda i, j: j > i)
    assert report.jacobian_leaks == report.leaks  # the gradients see every one of them too
    text = str(report)
    assert "position 0 depends on the token at 1" in text
    assert "FAILED" in text.splitlines()[0]
    assert "X" in report.grid()


def test_a_mask_off_by_one_leaks_exactly_the_next_token():
    off_by_one = masks.dense(torch.ones(T, T, dtype=torch.bool).tril(1))  # keys j ≤ i + 1
    report = audit.causality(OneLayerLM(lambda n: off_by_one), V, T)
    assert report.first_leak == (0, 1)
    assert report.leaks == tuple((i, i + 1) for i in range(T - 1))


def test_packed_documents_with_only_the_causal_mask_leak_across_documents():
    """The nanoVLM bug: documents packed in one row, attention causal but not per document."""
    doc = torch.tensor([0] * 3 + [1] * 4 + [2] * 3)
    packed = masks.causal() & masks.document(doc)
    model = gpt()
    leaky = audit.mask(lambda ids: model(ids), packed, V, T, embedding=model.tok_emb)
    assert leaky.first_leak == (3, 0)  # the first token of document 1 reads document 0
    assert leaky.leaks == all_pairs(T, lambda i, j: j < i and doc[i] != doc[j])
    assert leaky.declared == "causal() & document(ids)"
    assert "position 3 depends on the token at 0" in str(leaky)
    fixed = audit.mask(lambda ids: model(ids, packed), packed, V, T, embedding=model.tok_emb)
    assert fixed.ok and fixed.unread == (), str(fixed)


def test_a_bidirectional_bert_reads_every_token_and_hides_padding():
    torch.manual_seed(0)
    bert = BERT(BERTConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=32)).eval()
    report = audit.mask(bert, masks.full(), V, T)
    assert report.ok and report.unread == (), str(report)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, 7:] = False  # row 1: three pads on the right
    hidden = masks.padding(valid=valid)
    ok = audit.mask(lambda ids: bert(ids, valid), hidden, V, T, embedding=bert.tok_emb)
    assert ok.ok, str(ok)
    # the same model not told of the padding reads the pads: each query sees key 7 first
    leaky = audit.mask(bert, hidden, V, T)
    assert leaky.first_leak == (0, 7)
    assert leaky.leaks == all_pairs(T, lambda i, j: j >= 7 and i != j)


def test_a_seq2seq_decoder_is_causal_given_a_source():
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=V, tgt_vocab_size=V, d_model=16, n_heads=2, n_encoder_layers=1,
        n_decoder_layers=1, max_len=32,
    )  # fmt: skip
    model = Seq2Seq(config).eval()
    src = torch.randint(0, V, (2, 6))
    report = audit.causality(lambda tgt: model(src, tgt), V, T, embedding=model.tgt_emb)
    assert report.ok and report.unread == (), str(report)
    assert report.checked.jacobian.startswith("through the given Embedding")


def test_an_allowed_key_never_read_is_a_warning_not_a_leak():
    # attention hides key 0 from everyone but itself: allowed by causal(), never read
    ignores_0 = torch.ones(T, T, dtype=torch.bool).tril()
    ignores_0[1:, 0] = False
    report = audit.causality(OneLayerLM(lambda n: masks.dense(ignores_0)), V, T)
    assert report.ok, str(report)
    assert report.unread == tuple((i, 0) for i in range(1, T))
    assert "warning: 9 allowed pairs never read" in report.summary()
    assert "?" in report.grid()


def test_a_sliding_window_is_read_over_layers_unless_hops_says_one():
    model = gpt()
    window = masks.sliding_window(3)
    run = lambda **kw: audit.mask(  # noqa: E731
        lambda ids: model(ids, window), window, V, T, embedding=model.tok_emb, **kw
    )
    assert run(hops=2).ok  # two layers: i reads i − 4 … i through i − 2
    one_hop = run(hops=1)
    assert one_hop.first_leak == (3, 0)
    assert set(one_hop.leaks) == set(all_pairs(T, lambda i, j: 3 <= i - j <= 4))


def test_every_output_kind_is_read():
    model = gpt()
    plain = audit.causality(model, V, T, jacobian=False)
    assert plain.checked.jacobian.startswith("off")
    for wrap in (
        lambda ids: (model(ids), None),
        lambda ids: [model(ids)],
        lambda ids: type("Out", (), {"logits": model(ids)})(),
        lambda ids: type("Out", (), {"last_hidden_state": model(ids, return_hidden=True)})(),
    ):
        report = audit.causality(wrap, V, T)
        assert report.ok and report.leaks == plain.leaks
        assert report.checked.jacobian.startswith("skipped: the model is a plain function")


def test_bad_models_and_arguments_are_refused_in_words():
    model = gpt()
    with pytest.raises(TypeError, match="must return a tensor"):
        audit.causality(lambda ids: {"logits": model(ids)}, V, T)
    with pytest.raises(ValueError, match="one output per position"):
        audit.causality(lambda ids: model(ids)[:, -1], V, T)
    with pytest.raises(ValueError, match=r"call model\.eval"):
        dropout = torch.nn.Dropout(0.5).train()
        audit.causality(lambda ids: dropout(model(ids)), V, T)
    with pytest.raises(ValueError, match="NaN or inf"):
        audit.causality(lambda ids: model(ids) / 0, V, T)
    with pytest.raises(ValueError, match="vocab_size must be an int ≥ 2, got 1"):
        audit.causality(model, 1, T)
    with pytest.raises(ValueError, match="trials must be a positive int, got 0"):
        audit.causality(model, V, T, trials=0)
    with pytest.raises(ValueError, match="padding lengths has 3 entries but the batch has B=2"):
        audit.mask(model, masks.padding(torch.tensor([1, 2, 3])), V, T)
    with pytest.raises(TypeError, match="declared must be a dikkat Mask"):
        audit.mask(model, None, V, T)


def test_a_model_in_training_mode_is_audited_in_eval_mode_and_left_as_it_was():
    model = gpt(dropout=0.5).train()
    assert audit.causality(model, V, T).ok
    assert model.training


def test_the_audit_is_reexported_from_dikkat():
    assert dikkat.audit.causality is audit.causality
    assert {"causality", "mask", "kv_cache", "permutation"} <= set(dikkat.audit.__all__)
