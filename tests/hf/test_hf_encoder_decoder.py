"""dikkat.hf.register on encoder-decoder models: T5 (a relative position bias beside the mask)
and BART (cross-attention) give eager's logits, greedy tokens and gradients on every dikkat
backend (docs/hf.md).

Notation: ``B`` batch, ``S`` encoder tokens, ``T`` decoder tokens, ``V`` vocabulary.

The oracle is transformers' own ``attn_implementation="eager"`` in float32, on randomly
initialised tiny models built from configs (nothing downloaded). Each model makes three kinds
of attention call: the encoder's (bidirectional, the encoder's padding), the decoder's own
(causal, the decoder's padding, with a cache while generating) and cross-attention (T decoder
queries over the S encoder keys, the encoder's padding, never causal — with T ≠ S here, a
causal mask would hide keys and change the logits). T5 passes its relative position bias as
``position_bias=`` (scaling 1.0), in the decoder computed from the cached position.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import dikkat.hf

transformers = pytest.importorskip("transformers")

BACKENDS = ["reference", "tiled", "sdpa", "auto"]
# one registered name per backend ("sdpa" may not appear in a name: transformers would take it
# for torch's SDPA)
NAMES = {
    b: dikkat.hf.register(f"dikkat-test-ed-{b.replace('sdpa', 'fused')}", backend=b)
    for b in BACKENDS
}
TOL = 1e-5
B, S, T, V = 3, 12, 7, 97
S_LENGTHS = [12, 9, 5]  # real encoder tokens per row (right padding)
T_LENGTHS = [7, 6, 4]  # real decoder tokens per row
LAYERS = 2  # encoder layers, and decoder layers


# Both models' attention weighs more than at their default initialisation (T5's value and output
# projections 3× wider, BART's init_std): at the defaults a tiny random model greedily repeats one
# token whatever its attention does, and the generate test would not see a position bias left
# out or a cross-attention made causal. (T5's queries and keys keep their width: it does not
# scale its scores, and sharper ones would amplify float32 rounding past the tolerance.)


def t5(relative_bias: bool = True) -> nn.Module:
    # few buckets and a short max distance, so that T ≤ 12 reaches the logarithmic buckets too
    config = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_heads=4,
        num_layers=LAYERS, num_decoder_layers=LAYERS,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith((".v.weight", ".o.weight")):
                p.mul_(3.0)
    if not relative_bias:  # every position bias 0: the scores alone
        for stack in (model.encoder, model.decoder):
            table = stack.block[0].layer[0].SelfAttention.relative_attention_bias
            nn.init.zeros_(table.weight)
    return model


def bart() -> nn.Module:
    config = transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.2,
        forced_eos_token_id=None,  # generate's last token is the model's, not a forced end
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"t5": t5, "bart": bart}
# the attention class of each model, as dikkat.hf.recording names it
ATTENTION = {"t5": "T5Attention", "bart": "BartAttention"}


def _padded(n: int, lengths: list[int]) -> Tensor:
    """A (B, n) right-padding mask, 1 = real token."""
    return (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()


def make(name: str, seed: int = 0) -> tuple[nn.Module, dict[str, Tensor]]:
    """The model (eval, eager) and a padded batch: encoder ids and mask (B, S), decoder ids and
    mask (B, T)."""
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    model.set_attn_implementation("eager")
    pad = model.config.pad_token_id
    mask, decoder_mask = _padded(S, S_LENGTHS), _padded(T, T_LENGTHS)
    ids = torch.randint(3, V, (B, S)).masked_fill(mask == 0, pad)
    decoder_ids = torch.randint(3, V, (B, T)).masked_fill(decoder_mask == 0, pad)
    batch = dict(
        input_ids=ids, attention_mask=mask,
        decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask,
    )  # fmt: skip
    return model, batch


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_eager(name, backend):
    """Every decoder position, padded ones included: with right padding a padded decoder query
    still sees the real tokens before it, and every encoder query sees the real encoder keys."""
    model, batch = make(name)
    with torch.no_grad():
        want = model(**batch).logits
        model.set_attn_implementation(NAMES[backend])
        got = model(**batch).logits
    assert want.shape == (B, T, V)
    assert float((got - want).abs().max()) <= TOL
    assert float(want.abs().max()) > 0.01  # not a comparison of two zeros


def test_t5_position_bias_reaches_the_logits():
    """The same weights without T5's relative position bias give other logits: the comparisons
    above see whether the bias is added."""
    torch.manual_seed(0)
    biased = t5().eval()
    torch.manual_seed(0)
    unbiased = t5(relative_bias=False).eval()
    _, batch = make("t5")
    for model in (biased, unbiased):
        model.set_attn_implementation(NAMES["tiled"])
    with torch.no_grad():
        difference = biased(**batch).logits - unbiased(**batch).logits
    assert float(difference.abs().max()) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_t5_encoder_with_a_4d_float_mask_equals_eager(backend):
    """A (B, 1, S, S) additive mask the caller built passes through transformers unchanged: eager
    adds it and the position bias to the scores, dikkat takes their sum as its bias."""
    model, batch = make("t5")
    encoder = model.get_encoder()
    hidden = batch["attention_mask"][:, None, None, :] == 0  # (B, 1, 1, S) padding keys
    additive = torch.zeros(B, 1, S, S).masked_fill(hidden, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = encoder(input_ids=batch["input_ids"], attention_mask=additive).last_hidden_state
        model.set_attn_implementation(NAMES[backend])
        with dikkat.hf.recording() as calls:
            got = encoder(input_ids=batch["input_ids"], attention_mask=additive).last_hidden_state
        without = encoder(input_ids=batch["input_ids"]).last_hidden_state
    assert len(calls) == LAYERS  # through dikkat
    assert float((got - want).abs().max()) <= TOL
    assert float((without - want).abs().max()) > 1e-3  # the mask changes what the encoder sees


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generate_with_cache_equals_eager(name, backend, cache):
    """One query per step over the cached decoder keys (T5's bias computed from the cache's
    length), and cross-attention over the encoder keys computed once and cached."""
    model, batch = make(name, seed=1)
    new = 6
    kwargs = dict(
        attention_mask=batch["attention_mask"], max_new_tokens=new, min_new_tokens=new,
        do_sample=False, use_cache=True, cache_implementation=cache,
    )  # fmt: skip
    want = model.generate(batch["input_ids"], **kwargs)
    model.set_attn_implementation(NAMES[backend])
    got = model.generate(batch["input_ids"], **kwargs)
    assert want.shape == (B, 1 + new)  # the decoder's start token and the new ones
    assert torch.equal(got, want)


def _grads(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    model.zero_grad()
    # labels: the decoder ids, padding not read (the model shifts them right into its input)
    labels = batch["decoder_input_ids"].masked_fill(batch["decoder_attention_mask"] == 0, -100)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    model(**inputs, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_equal_eager(name, backend):
    """Of every parameter, the encoder's and the decoder's (T5's relative position bias tables
    among them: their gradient flows back through dikkat's ``bias``)."""
    model, batch = make(name, seed=2)
    model.train()  # every dropout is 0: train mode changes nothing but what HF passes
    want = _grads(model, batch)
    model.set_attn_implementation(NAMES[backend])
    got = _grads(model, batch)
    assert got.keys() == want.keys() and len(want) > 10
    for stack in ("encoder.", "decoder."):  # T5's "encoder.…", BART's "model.encoder.…"
        assert any(k.startswith((stack, f"model.{stack}")) for k in want), stack
    if name == "t5":
        tables = [k for k in want if k.endswith("relative_attention_bias.weight")]
        assert len(tables) == 2  # the encoder's and the decoder's
        assert all(float(want[k].abs().max()) > 1e-4 for k in tables)
    for key in want:
        scale = max(1.0, float(want[key].abs().max()))
        assert float((got[key] - want[key]).abs().max()) <= TOL * scale, key
    assert any(float(g.abs().max()) > 1e-3 for g in want.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_recording_lists_the_cross_attention_calls(name):
    """Every encoder layer's call, then each decoder layer's two — its own and cross-attention
    (the same module class and layer index) — all through dikkat, on the backend registered."""
    model, batch = make(name)
    model.set_attn_implementation(NAMES["tiled"])
    with torch.no_grad(), dikkat.hf.recording() as calls:
        model(**batch)
    layer = [f"{ATTENTION[name]}[{i}]" for i in range(LAYERS)]
    decoder = [call for i in range(LAYERS) for call in (layer[i], layer[i])]  # self, cross
    assert [c.layer for c in calls] == layer + decoder
    assert {c.backend for c in calls} == {"tiled"}
    # the shapes tell them apart: (B, H, T, S) with S encoder keys for cross-attention
    encoder, self_, cross = (B, 4, S, S), (B, 4, T, T), (B, 4, T, S)
    assert [c.shape for c in calls] == [encoder] * LAYERS + [self_, cross] * LAYERS
    # generating, each step's decoder makes its own call and a cross-attention call per layer
    with dikkat.hf.recording() as calls:
        model.generate(
            batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=3,
            min_new_tokens=3, do_sample=False,
        )  # fmt: skip
    assert len(calls) == LAYERS + 3 * 2 * LAYERS
