"""GPT: shapes, presets and parameter count, causality, argument checks (docs/contract.md §11, §17).

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from dikkat.core.masks import full
from dikkat.models import GPT, GPT_PRESETS, GPTConfig
from helpers import scramble

V = 53


def small(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    fields = dict(vocab_size=V, max_len=24, d_model=32, n_layers=2, n_heads=4)
    fields.update(overrides)
    return scramble(GPT(GPTConfig(**fields)), seed)


def random_ids(B: int, T: int, seed: int) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


VARIANTS = {
    "learned": {},
    "rope": dict(position="rope"),
    "gqa": dict(n_kv_heads=2),
    "gqa-rope": dict(position="rope", n_kv_heads=1),
}


# --- shapes and presets ----------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_hidden_shapes(variant):
    model = small(**VARIANTS[variant])
    ids = random_ids(3, 11, seed=1)
    with torch.no_grad():
        assert model(ids).shape == (3, 11, V)
        assert model(ids, return_hidden=True).shape == (3, 11, 32)
        assert model(ids[:, :1]).shape == (3, 1, V)


def test_the_output_embedding_is_tied_by_default_and_untied_on_request():
    tied = GPT(GPTConfig(vocab_size=V, max_len=8, d_model=16, n_layers=1, n_heads=2))
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = GPT(dataclasses.replace(tied.config, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.n_params == tied.n_params + V * 16


def test_tiny_preset_is_the_default_config():
    assert GPTConfig.preset("tiny") == GPTConfig()
    model = GPT(GPTConfig.preset("tiny"))
    assert model(torch.randint(0, 256, (2, 5))).shape == (2, 5, 256)


def test_gpt2_small_preset_has_gpt2_sizes():
    c = GPTConfig.preset("gpt2-small")
    assert (c.n_layers, c.n_heads, c.d_model, c.vocab_size, c.max_len) == (12, 12, 768, 50257, 1024)
    assert c.position == "learned" and c.activation == "gelu_tanh" and c.tie_embeddings
    assert c.norm_eps == 1e-5


def gpt2_formula(V: int, L: int, C: int, n: int) -> int:
    """GPT-2's parameters counted by hand, the tied output embedding once."""
    embeddings = V * C + L * C
    attention = C * 3 * C + 3 * C + C * C + C  # fused q/k/v and the output projection
    mlp = C * 4 * C + 4 * C + 4 * C * C + C
    norms = 2 * 2 * C
    return embeddings + n * (attention + mlp + norms) + 2 * C  # + the final LayerNorm


def test_gpt2_small_parameter_count_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):  # shapes only: no 124M parameters allocated
        ours = GPT(GPTConfig.preset("gpt2-small"))
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    hf_count = sum(p.numel() for p in hf.parameters())  # counts the tied lm_head once
    assert ours.n_params == hf_count == gpt2_formula(50257, 1024, 768, 12)
    assert 124e6 < ours.n_params < 125e6


def test_preset_overrides_and_unknown_presets():
    c = GPTConfig.preset("gpt2-small", n_layers=2)
    assert c.n_layers == 2 and c.d_model == 768
    assert GPT_PRESETS["gpt2-small"].n_layers == 12  # the preset itself is untouched
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("gpt5")


@pytest.mark.parametrize(
    "fields",
    [
        dict(position="alibi"),
        dict(n_heads=3),  # does not divide d_model 32
        dict(n_kv_heads=3),  # does not divide 4 heads
        dict(vocab_size=0),
        dict(max_len=0),
        dict(n_layers=0),
    ],
)
def test_bad_configs_raise(fields):
    base = dict(vocab_size=V, max_len=8, d_model=32, n_layers=1, n_heads=4)
    with pytest.raises(ValueError):
        GPTConfig(**{**base, **fields})


# --- causality -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("t", [0, 4, 9])
def test_changing_a_future_token_never_changes_earlier_logits(variant, t):
    model = small(seed=2, **VARIANTS[variant])
    ids = random_ids(2, 10, seed=3)
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % V
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    # the changed position itself (and so the audit) does see the change
    assert (a[:, t] - b[:, t]).abs().amax() > 1e-2


# --- argument checks -------------------------------------------------------------------------


def test_forward_rejects_bad_ids_and_overlong_sequences():
    model = small()
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="context"):
        model(random_ids(1, 25, seed=0))
    with pytest.raises(ValueError, match="context"):
        model(random_ids(1, 4, seed=0), offset=21)


def test_forward_rejects_a_cache_with_the_wrong_number_of_layers():
    model = small()
    cache = model.new_cache(1, 8)[:1]
    with pytest.raises(ValueError, match="layers"):
        model(random_ids(1, 4, seed=0), cache=cache)


def test_positions_shift_learned_embeddings():
    """Explicit positions equal to offset … offset+T−1 give the same logits as ``offset``."""
    model = small(seed=4)
    ids = random_ids(2, 5, seed=5)
    with torch.no_grad():
        by_offset = model(ids, offset=3)
        by_positions = model(ids, positions=torch.arange(3, 8))
        from_zero = model(ids)
    torch.testing.assert_close(by_offset, by_positions, rtol=0, atol=0)
    assert (by_offset - from_zero).abs().amax() > 1e-2


@pytest.mark.parametrize("variant", ["learned", "gqa-rope"])
def test_last_only_gives_the_last_positions_logits(variant):
    model = small(seed=6, **VARIANTS[variant])
    ids = random_ids(2, 7, seed=7)
    with torch.no_grad():
        full = model(ids)
        last = model(ids, last_only=True)
    assert last.shape == (2, 1, V)
    torch.testing.assert_close(last, full[:, -1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_loss_equals_cross_entropy_of_the_logits_with_the_same_gradients(tied):
    """GPT.loss never holds the logits, yet gives the plain loss and gradients (fp64)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=29, max_len=16, tie_embeddings=tied)).double()
    ids = torch.randint(0, 29, (2, 9))
    targets = torch.randint(0, 29, (2, 9))
    targets[0, :3] = -100  # skipped positions
    loss = model.loss(ids, targets)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)
    with pytest.raises(ValueError, match=r"shape of ids \(2, 9\)"):
        model.loss(ids, targets[:, :4])


# --- padding: valid --------------------------------------------------------------------------


def padded(rows: list[Tensor], side: str, T: int, pad: int = 7) -> tuple[Tensor, Tensor]:
    """Rows of different lengths padded to T on ``side`` with ``pad`` (a real id, not 0), and
    ``valid`` (B, T)."""
    ids = torch.full((len(rows), T), pad)
    valid = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, row in enumerate(rows):
        where = slice(T - len(row), T) if side == "left" else slice(0, len(row))
        ids[b, where], valid[b, where] = row, True
    return ids, valid


def uneven_rows(lengths: tuple[int, ...], seed: int) -> list[Tensor]:
    return [random_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_with_valid_each_padded_row_computes_what_it_computes_alone(variant, side):
    model = small(seed=5, **VARIANTS[variant]).double()
    rows = uneven_rows((4, 9, 1, 6), seed=40)
    ids, valid = padded(rows, side, 9)
    with torch.no_grad():
        batch = model(ids, valid=valid)
        for b, row in enumerate(rows):
            torch.testing.assert_close(batch[b][valid[b]], model(row[None])[0], rtol=0, atol=1e-12)
        leaky = model(ids)
    if side == "left":  # not trivially true: without valid the pads are keys and shift positions
        assert (leaky[valid] - batch[valid]).abs().amax() > 1e-3


def test_a_given_mask_is_combined_with_valid():
    """``mask & padding(valid)``: full attention among the real tokens of each row only."""
    model = small(seed=6).double()
    rows = uneven_rows((3, 8, 5), seed=50)
    ids, valid = padded(rows, "right", 8)
    with torch.no_grad():
        batch = model(ids, full(), valid=valid)
        for b, row in enumerate(rows):
            alone = model(row[None], full())[0]
            torch.testing.assert_close(batch[b][valid[b]], alone, rtol=0, atol=1e-12)
        leaky = model(ids, full())  # right pads are seen by every token under full()
    assert (leaky[valid] - batch[valid]).abs().amax() > 1e-3


@pytest.mark.parametrize("side", ["left", "right"])
def test_loss_with_valid_equals_the_loss_of_each_row_alone(side):
    model = small(seed=7, position="rope").double()
    rows = uneven_rows((5, 2, 7), seed=60)
    ids, valid = padded(rows, side, 7)
    targets = random_ids(3, 7, seed=61).masked_fill(~valid, -100)  # no loss at the pads
    with torch.no_grad():
        loss = model.loss(ids, targets, valid=valid)
        unmasked = model.loss(ids, targets)
        total = sum(
            torch.nn.functional.cross_entropy(
                model(row[None])[0], targets[b][valid[b]], reduction="sum"
            )
            for b, row in enumerate(rows)
        )
    torch.testing.assert_close(loss, total / int(valid.sum()), rtol=1e-12, atol=1e-12)
    if side == "left":
        assert abs(float(unmasked) - float(loss)) > 1e-3


def test_rope_angles_are_computed_once_per_pass(monkeypatch):
    """Every layer is given the one positions tensor of the pass (:meth:`Generates.forward`),
    so the shared RoPE computes its table once, not once per layer."""
    model = GPT(GPTConfig(vocab_size=V, max_len=16, d_model=32, n_layers=3, n_heads=4,
                          position="rope")).eval()  # fmt: skip
    rope = model._ropes[0]
    calls = []
    computed = rope._angles
    monkeypatch.setattr(rope, "_angles", lambda *a: calls.append(1) or computed(*a))
    model(torch.randint(0, V, (1, 5)))
    model(torch.randint(0, V, (1, 5)))
    assert len(calls) == 2
