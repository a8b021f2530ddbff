"""gpt_from_hf: Hugging Face GPT-2 weights give HF's logits and HF's greedy tokens (docs/contract.md
§11).

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``V`` vocabulary.

Hugging Face is the oracle: randomly initialised ``GPT2LMHeadModel``s of several sizes, built from
configs (no network), compared in float32.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dikkat.interop import gpt_from_hf
from dikkat.models import GPTConfig
from helpers import scramble as scramble_weights

transformers = pytest.importorskip("transformers")

# (vocab, n_embd, n_layer, n_head, n_positions, n_inner, activation)
SIZES = [
    (97, 32, 2, 4, 64, None, "gelu_new"),
    (50, 48, 3, 3, 40, 80, "gelu_new"),
    (131, 64, 1, 8, 128, None, "gelu_pytorch_tanh"),
    (64, 24, 2, 2, 32, 40, "gelu"),
]


def hf_gpt2(size: tuple, seed: int, **extra: object):
    V, C, L, H, P, inner, act = size
    config = transformers.GPT2Config(
        vocab_size=V,
        n_embd=C,
        n_layer=L,
        n_head=H,
        n_positions=P,
        n_inner=inner,
        activation_function=act,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=V - 1,
        eos_token_id=V - 1,
        **extra,
    )
    torch.manual_seed(seed)
    return scramble(transformers.GPT2LMHeadModel(config), seed)


def scramble(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """HF GPT-2's Conv1D weights are (in, out): their fan-in is the first dim."""
    return scramble_weights(
        model, seed, lambda name, p: p.shape[0] if ".h." in name else p.shape[1]
    )


def random_ids(V: int, B: int, T: int, seed: int) -> Tensor:
    # avoid the eos id V−1, which HF's generate would stop at
    return torch.randint(0, V - 1, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("size", SIZES, ids=[f"C{s[1]}-L{s[2]}-H{s[3]}" for s in SIZES])
def test_logits_equal_hugging_face(size):
    hf = hf_gpt2(size, seed=1)
    ours = gpt_from_hf(hf).eval()
    V, C, L, H, P = size[:5]
    assert (ours.config.vocab_size, ours.config.d_model, ours.config.n_layers) == (V, C, L)
    assert (ours.config.n_heads, ours.config.max_len) == (H, P)
    assert ours.lm_head.weight is ours.tok_emb.weight
    ids = random_ids(V, 3, P, seed=2)  # the whole context
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert expected.abs().amax() > 1.0  # order-one logits: 1e-5 is a tight bound
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_valid_equals_hugging_faces_attention_mask(side):
    """``valid`` is HF's ``attention_mask`` as bool; HF counts the positions of a left-padded row
    from its first real token only when given ``position_ids`` (its generate computes them)."""
    size = SIZES[1]
    hf = hf_gpt2(size, seed=16)
    ours = gpt_from_hf(hf).eval()
    lengths, T = (9, 3, 6), 9
    ids = random_ids(size[0], 3, T, seed=17)
    valid = torch.arange(T) < torch.tensor(lengths).unsqueeze(1)  # right padding
    if side == "left":
        valid = valid.flip(1)
    with torch.no_grad():
        position_ids = (valid.long().cumsum(-1) - 1).clamp_min(0)
        expected = hf(ids, attention_mask=valid.long(), position_ids=position_ids).logits
        got = ours(ids, valid=valid)
    torch.testing.assert_close(got[valid], expected[valid], rtol=0, atol=1e-5)


@pytest.mark.parametrize("size", SIZES[:2], ids=["C32", "C48"])
def test_from_a_state_dict_and_config(size):
    hf = hf_gpt2(size, seed=3)
    ids = random_ids(size[0], 2, 9, seed=4)
    with torch.no_grad():
        expected = hf(ids).logits
        # with the HF config, and with a hand-made GPTConfig
        a = gpt_from_hf(hf.state_dict(), hf.config).eval()(ids)
        cfg = GPTConfig(
            vocab_size=size[0],
            max_len=size[4],
            d_model=size[1],
            n_layers=size[2],
            n_heads=size[3],
            d_ff=size[5],
        )
        b = gpt_from_hf(hf.state_dict(), cfg).eval()(ids)
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(b, expected, rtol=0, atol=1e-5)


def test_from_a_gpt2_model_without_head():
    hf_lm = hf_gpt2(SIZES[0], seed=5)
    hf = hf_lm.transformer  # GPT2Model: keys without the "transformer." prefix
    ours = gpt_from_hf(hf).eval()
    ids = random_ids(SIZES[0][0], 2, 12, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, return_hidden=True), hf(ids).last_hidden_state, rtol=0, atol=1e-5
        )
        torch.testing.assert_close(ours(ids), hf_lm(ids).logits, rtol=0, atol=1e-5)


def test_an_untied_lm_head_loads_untied():
    hf = hf_gpt2(SIZES[0], seed=7, tie_word_embeddings=False)
    assert hf.lm_head.weight is not hf.transformer.wte.weight
    ours = gpt_from_hf(hf).eval()
    assert not ours.config.tie_embeddings
    assert ours.lm_head.weight is not ours.tok_emb.weight
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)
    ids = random_ids(SIZES[0][0], 2, 10, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-5)


def test_loaded_weights_are_copies():
    hf = hf_gpt2(SIZES[0], seed=9)
    ours = gpt_from_hf(hf)
    with torch.no_grad():
        hf.transformer.wte.weight.zero_()
    assert ours.tok_emb.weight.abs().amax() > 0


# --- greedy generation -----------------------------------------------------------------------


def hf_greedy(hf, ids: Tensor, steps: int, attention_mask: Tensor | None = None) -> Tensor:
    eos = hf.config.eos_token_id
    with torch.no_grad():
        return hf.generate(
            ids,
            attention_mask=torch.ones_like(ids) if attention_mask is None else attention_mask,
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=eos,
        )


@pytest.mark.parametrize("size", SIZES[:3], ids=["C32", "C48", "C64"])
def test_greedy_generate_returns_hugging_faces_tokens(size):
    hf = hf_gpt2(size, seed=10)
    ours = gpt_from_hf(hf)
    ids = random_ids(size[0], 2, 6, seed=11)
    steps = 20
    expected = hf_greedy(hf, ids, steps).tolist()
    # HF fills the rows that stopped with eos (its pad_token_id here); ours cuts them after eos
    eos = hf.config.eos_token_id
    got = ours.generate(ids, steps, eos_id=eos)
    assert got == [stop_after(r, 6, eos) for r in expected]
    assert max(len(r) for r in got) > 6


def test_greedy_generate_until_eos_matches_hugging_face():
    """A model whose greedy path meets eos: both stop there."""
    size = SIZES[0]
    hf = hf_gpt2(size, seed=12)
    ours = gpt_from_hf(hf)
    ids = random_ids(size[0], 1, 4, seed=13)
    free = ours.generate(ids, 30)[0][4:]
    eos = free[5]  # make a token it produces the eos
    hf.generation_config.eos_token_id = eos
    hf.config.eos_token_id = eos
    expected = hf_greedy(hf, ids, 30)
    got = ours.generate(ids, 30, eos_id=eos)
    assert got == expected.tolist()
    assert len(got[0]) == 4 + free.index(eos) + 1


def test_left_padded_batch_generates_hugging_faces_tokens():
    size = SIZES[1]
    hf = hf_gpt2(size, seed=14)
    ours = gpt_from_hf(hf)
    V = size[0]
    prompts = [random_ids(V, 1, n, seed=15 + n)[0].tolist() for n in (6, 2, 4)]
    steps = 12
    got = ours.generate(prompts, steps, eos_id=V - 1)
    alone = [hf_greedy(hf, torch.tensor([p]), steps)[0].tolist() for p in prompts]
    assert got == [stop_after(r, len(p), V - 1) for r, p in zip(alone, prompts, strict=True)]
    # and HF's own left-padded batch (its attention mask hides the pads) agrees
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[V - 1] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    batch = hf_greedy(hf, ids, steps, attention_mask=mask).tolist()
    unpadded = [r[T - len(p) :] for r, p in zip(batch, prompts, strict=True)]
    assert got == [stop_after(r, len(p), V - 1) for r, p in zip(unpadded, prompts, strict=True)]


def stop_after(row: list[int], n_prompt: int, eos: int) -> list[int]:
    new = row[n_prompt:]
    return row[:n_prompt] + (new[: new.index(eos) + 1] if eos in new else new)


# --- bad inputs ------------------------------------------------------------------------------


def tiny_gpt2_config(**fields: object):
    return transformers.GPT2Config(
        vocab_size=30,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        **fields,
    )


def test_a_bert_state_dict_is_rejected():
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=30,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    )
    gpt_config = tiny_gpt2_config()
    with pytest.raises(ValueError, match="GPT-2"):
        gpt_from_hf(bert.state_dict(), gpt_config)
    with pytest.raises(ValueError):
        gpt_from_hf(bert.state_dict())


def test_a_state_dict_without_config_is_rejected():
    hf = hf_gpt2(SIZES[0], seed=16)
    with pytest.raises(ValueError, match="config"):
        gpt_from_hf(hf.state_dict())


def test_a_config_that_does_not_fit_the_weights_is_rejected():
    hf = hf_gpt2(SIZES[0], seed=17)
    V, C, L, H, P = SIZES[0][:5]
    wrong = GPTConfig(vocab_size=V, max_len=P, d_model=C, n_layers=L, n_heads=H, d_ff=3 * C)
    with pytest.raises(ValueError, match="does not fit the model's config"):
        gpt_from_hf(hf.state_dict(), wrong)


@pytest.mark.parametrize(
    "flag",
    [
        dict(scale_attn_by_inverse_layer_idx=True),
        dict(reorder_and_upcast_attn=True),
        dict(scale_attn_weights=False),
        dict(activation_function="relu"),
    ],
)
def test_configs_without_an_equivalent_are_rejected(flag):
    config = tiny_gpt2_config(**flag)
    hf = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError):
        gpt_from_hf(hf)
