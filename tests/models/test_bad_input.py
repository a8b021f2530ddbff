"""Bad input anywhere a user can give it: every error says which argument and what was wrong.

Notation: ``B`` batch, ``T`` tokens, ``V`` vocabulary, ``C`` width.

A wrong kind of value (a float or bool where an int goes, a string, None) is a ``TypeError``; a
value of the right kind outside its range a ``ValueError``. Each case asserts the type and that
the message names the argument. Bad values are drawn by hypothesis per field where there is a
family of them (sizes, probabilities, epsilons, seeds); the cases already covered next to each
module (non-positive sizes that tests/layers checks, empty prompts, …) are not repeated here.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dikkat.generation import KVCache, generate, iter_generate
from dikkat.layers import (
    MLP,
    ALiBi,
    Block,
    BlockConfig,
    LayerNorm,
    LearnedPositionalEmbedding,
    Linear,
    MultiHeadAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)
from dikkat.models import BERT, GPT, BERTConfig, GPTConfig, Seq2Seq, Seq2SeqConfig
from dikkat.vision import DETR, ViT, ViTConfig
from dikkat.vision.detr import DETRConfig
from dikkat.vision.psa import C2PSA, Attention, C3k2, Conv, PSABlock
from dikkat.vision.shapes import ShapesConfig

V = 53  # GPT and BERT vocabulary
SRC_V, TGT_V = 41, 37

# --- bad values, as (value, the error it must raise) ----------------------------------------------

not_a_number = st.sampled_from(["4", None, [4], b"4"]).map(lambda v: (v, TypeError))
flags = st.booleans().map(lambda v: (v, TypeError))  # bool is an int in Python; never a size
floats = st.floats(allow_nan=True, allow_infinity=True).map(lambda v: (v, TypeError))


def no_number(optional: bool) -> st.SearchStrategy:
    """A string, a list, bytes, or None (unless None is allowed)."""
    return not_a_number.filter(lambda vt: not (optional and vt[0] is None))


def bad_size(optional: bool = False, at_least: int = 1) -> st.SearchStrategy:
    """A size that is no size: too small, a float (2.0 too), a bool, a string (None unless
    ``optional``)."""
    kinds = no_number(optional)
    small = st.integers(max_value=at_least - 1).map(lambda v: (v, ValueError))
    return st.one_of(small, floats, flags, kinds)


def bad_float(
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> st.SearchStrategy:
    """A number outside the interval (ends open as named), NaN or infinite, or no number (None
    too, unless ``optional``)."""
    outside = st.floats().filter(
        lambda x: x < low or x > high or (low_open and x == low) or (high_open and x == high)
    )
    ends = [low] * low_open + [high] * high_open
    special = st.sampled_from([math.nan, math.inf, -math.inf, *ends])
    kinds = no_number(optional)
    return st.one_of((outside | special).map(lambda v: (v, ValueError)), flags, kinds)


def bad_id(vocab: int, optional: bool = False) -> st.SearchStrategy:
    """A token id outside [0, vocab), or no int (None too, unless ``optional``)."""
    outside = st.integers(min_value=vocab) | st.integers(max_value=-1)
    kinds = no_number(optional)
    return st.one_of(outside.map(lambda v: (v, ValueError)), floats, flags, kinds)


bad_eps = bad_float(0.0, low_open=True)  # eps = 0 divides 0 by 0 on a constant row
bad_probability = bad_float(0.0, 1.0, high_open=True)
bad_flag = st.sampled_from([0, 1, "yes", None]).map(lambda v: (v, TypeError))
bad_name = st.text(max_size=6).map(lambda v: (v, ValueError))


def raises_naming(field: str, error: type[Exception], build) -> None:
    """``build()`` raises ``error`` saying ``field must …`` or ``field=value …``."""
    with pytest.raises(error, match=rf"\b{field}(=| must )"):
        build()


# --- 1. configuration fields ----------------------------------------------------------------------

CONFIGS = {
    GPTConfig: dict(vocab_size=V, max_len=16, d_model=32, n_layers=1, n_heads=4),
    BERTConfig: dict(vocab_size=V, max_len=16, d_model=32, n_layers=1, n_heads=4),
    Seq2SeqConfig: dict(d_model=32, n_heads=4, n_encoder_layers=1, n_decoder_layers=1),
    BlockConfig: dict(d_model=32, n_heads=4),
    ViTConfig: dict(d_model=32, n_layers=1, n_heads=4),
    DETRConfig: dict(d_model=32, n_layers=1, n_heads=4),
    ShapesConfig: dict(),
}


def sizes(names: str) -> dict[str, st.SearchStrategy]:
    return dict.fromkeys(names.split(), bad_size())


# fields every config with blocks has; position, norm and pool have tests beside their models
BLOCK = dict(
    d_ff=bad_size(optional=True), dropout=bad_probability, norm_eps=bad_eps, activation=bad_name
)
FIELDS = {  # field → what makes a bad value of it
    GPTConfig: dict(
        **sizes("vocab_size max_len d_model n_layers n_heads"),
        **BLOCK,
        n_kv_heads=bad_size(optional=True),
        rope_base=bad_eps,
        bias=bad_flag,
        tie_embeddings=bad_flag,
    ),
    BERTConfig: dict(
        **sizes("vocab_size max_len d_model n_layers n_heads type_vocab_size"),
        **BLOCK,
        mlm_head=bad_flag,
    ),
    Seq2SeqConfig: dict(
        **sizes("src_vocab_size tgt_vocab_size max_len d_model n_heads"),
        **sizes("n_encoder_layers n_decoder_layers"),
        **BLOCK,
        share_embeddings=bad_flag,
        tie_output=bad_flag,
    ),
    BlockConfig: dict(
        **sizes("d_model n_heads"),
        **BLOCK,
        n_kv_heads=bad_size(optional=True),
        bias=bad_flag,
        cross_attention=bad_flag,
    ),
    ViTConfig: dict(
        **sizes("image_size channels patch_size n_classes d_model n_layers n_heads"),
        **BLOCK,
        patch_overlap=bad_size(at_least=0),
    ),
    DETRConfig: dict(
        **sizes("image_size n_classes n_queries width n_strides d_model psa_blocks n_layers"),
        n_heads=bad_size(),
        d_ff=bad_size(optional=True),
        dropout=bad_probability,
    ),
    ShapesConfig: sizes("image_size min_shapes max_shapes min_size max_size"),
}
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


@pytest.mark.parametrize(
    ("config", "field"),
    [(c, f) for c, fields in FIELDS.items() for f in fields],
    ids=lambda x: getattr(x, "__name__", x),
)
@given(data=st.data())
def test_every_config_field_rejects_bad_values_by_name(config, field, data):
    value, error = data.draw(FIELDS[config][field])
    if field == "activation" and value in ACTIVATIONS:
        return  # a drawn name that happens to be a valid choice
    raises_naming(field, error, lambda: config(**{**CONFIGS[config], field: value}))


def test_a_config_edited_on_disk_is_checked_when_loaded(tmp_path):
    torch.manual_seed(0)
    GPT(GPTConfig(**CONFIGS[GPTConfig])).save(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["config"]["norm_eps"] = -1e-5  # every LayerNorm output would be NaN
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"norm_eps must be a finite number > 0, got -1e-05"):
        GPT.load(tmp_path)


# --- 1. layer constructors ------------------------------------------------------------------------

LAYER_SIZES = {  # (layer, field) → build with the drawn value in that field
    ("MultiHeadAttention", "d_model"): lambda v: MultiHeadAttention(v, 2),
    ("MultiHeadAttention", "n_heads"): lambda v: MultiHeadAttention(16, v),
    ("MultiHeadAttention", "head_dim"): lambda v: MultiHeadAttention(16, 2, head_dim=v),
    ("MultiHeadAttention", "context_dim"): lambda v: MultiHeadAttention(16, 2, context_dim=v),
    ("LayerNorm", "d_model"): lambda v: LayerNorm(v),
    ("MLP", "d_model"): lambda v: MLP(v),
    ("MLP", "hidden"): lambda v: MLP(8, v),
    ("Linear", "in_features"): lambda v: Linear(v, 4),
    ("Linear", "out_features"): lambda v: Linear(4, v),
    ("RotaryEmbedding", "head_dim"): lambda v: RotaryEmbedding(v),
    ("RotaryEmbedding", "max_len"): lambda v: RotaryEmbedding(8, max_len=v),
    ("ALiBi", "n_heads"): lambda v: ALiBi(v),
    ("Sinusoidal", "d_model"): lambda v: SinusoidalPositionalEncoding(v),
    ("Sinusoidal", "max_len"): lambda v: SinusoidalPositionalEncoding(8, v),
    ("Learned", "max_len"): lambda v: LearnedPositionalEmbedding(v, 8),
    ("Learned", "d_model"): lambda v: LearnedPositionalEmbedding(8, v),
    ("KVCache", "batch"): lambda v: KVCache(v, 2, 4, 8),
    ("KVCache", "head_dim"): lambda v: KVCache(1, 2, 4, v),
    ("Conv", "c2"): lambda v: Conv(8, v),
    ("Conv", "k"): lambda v: Conv(8, 8, v),
    ("Attention", "num_heads"): lambda v: Attention(8, v),
    ("C3k2", "g"): lambda v: C3k2(8, 8, g=v),
}


@pytest.mark.parametrize("key", list(LAYER_SIZES), ids="-".join)
@given(bad=bad_size())
def test_layer_sizes_reject_zero_negative_float_and_string_sizes(key, bad):
    value, error = bad
    if value is None:
        return  # None is a default for some of these sizes
    raises_naming(key[1], error, lambda: LAYER_SIZES[key](value))


LAYER_ARGUMENTS = {  # case → (build, the argument named, error)
    "mha-backend": (lambda: MultiHeadAttention(16, 2, backend="nope"), "backend", ValueError),
    "block-backend": (lambda: Block(BlockConfig(16, 2), backend="flash"), "backend", ValueError),
    "vit-backend": (lambda: ViT(ViTConfig.preset("tiny"), backend="x"), "backend", ValueError),
    "c3k2-backend": (lambda: C3k2(8, 8, attn=False, backend="x"), "backend", ValueError),
    "mha-dropout": (lambda: MultiHeadAttention(16, 2, dropout=1.0), "dropout", ValueError),
    "mha-bias": (lambda: MultiHeadAttention(16, 2, bias="no"), "bias", TypeError),
    "mha-rope": (lambda: MultiHeadAttention(16, 2, rope=object()), "rope", TypeError),
    "layernorm-eps": (lambda: LayerNorm(8, eps=math.nan), "eps", ValueError),
    "rope-base-0": (lambda: RotaryEmbedding(8, base=0.0), "base", ValueError),
    "rope-base-negative": (lambda: RotaryEmbedding(8, base=-1e4), "base", ValueError),
    "alibi-symmetric": (lambda: ALiBi(4, symmetric="yes"), "symmetric", TypeError),
    "kvcache-dtype": (lambda: KVCache(1, 2, 4, 8, dtype=torch.long), "dtype", TypeError),
    "psa-attn_ratio": (lambda: Attention(8, 2, attn_ratio=math.nan), "attn_ratio", ValueError),
    "psa-shortcut": (lambda: PSABlock(8, num_heads=2, shortcut=1), "shortcut", TypeError),
    "c2psa-e": (lambda: C2PSA(8, 8, e=math.nan), "e", ValueError),
    "block-config": (lambda: Block({"d_model": 16}), "config", TypeError),
}


@pytest.mark.parametrize("case", list(LAYER_ARGUMENTS))
def test_layer_arguments_are_checked_at_construction(case):
    build, field, error = LAYER_ARGUMENTS[case]
    raises_naming(field, error, build)


# --- 2. token ids and images ----------------------------------------------------------------------


def gpt(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CONFIGS[GPTConfig], **overrides})).eval()


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


GPT_MODEL = gpt()  # shared: the bad calls never change them
S2S = dict(src_vocab_size=SRC_V, tgt_vocab_size=TGT_V, max_len=16)
SEQ2SEQ = Seq2Seq(Seq2SeqConfig(**{**CONFIGS[Seq2SeqConfig], **S2S})).eval()


def test_out_of_vocabulary_ids_are_named_with_the_value_and_where():
    model, bert, s2s = GPT_MODEL, BERT(BERTConfig(**CONFIGS[BERTConfig])), SEQ2SEQ
    cases = [
        (lambda: model(ids([1, 2, 60])), r"ids holds 60 at \(0, 2\), outside the vocabulary of 53"),
        (lambda: model(ids([1, -1])), r"ids holds -1 at \(0, 1\)"),
        (lambda: model.loss(ids([1, 2]), ids([3, 99])), r"targets holds 99 at \(0, 1\)"),
        (lambda: model.generate([[1, 300]], 2), r"prompts holds 300 at \(0, 1\)"),
        (lambda: model.generate(ids([1, 53]), 2), r"prompts holds 53 at \(0, 1\)"),
        (lambda: generate(model, [[1], [2, 54]], 2), r"prompts holds 54 at \(1, 1\)"),
        (lambda: bert(ids([1, 99])), r"ids holds 99 at \(0, 1\)"),
        (lambda: bert(ids([1, 2]), None, ids([0, 2])), r"token_type_ids holds 2 at \(0, 1\)"),
        (lambda: s2s(ids([SRC_V]), ids([1])), rf"src holds {SRC_V} at \(0, 0\)"),
        (lambda: s2s(ids([1]), ids([1, TGT_V])), rf"tgt holds {TGT_V} at \(0, 1\)"),
        (lambda: s2s.generate([[1, 2, SRC_V]], 3, bos_id=1), rf"prompts holds {SRC_V}"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_ids_of_the_wrong_kind_are_type_errors():
    model, s2s = GPT_MODEL, SEQ2SEQ
    cases = [
        (lambda: model.generate([[1.5, 2.7]], 3), r"prompts\[0\]\[0\] is 1.5 \(float\)"),
        (lambda: model(torch.ones(1, 3, dtype=torch.bool)), "ids must be an integer tensor"),
        (lambda: model(ids([1, 2]).to(torch.int16)), "ids .* got dtype torch.int16"),
        (lambda: model.loss(ids([1, 2]), torch.ones(1, 2)), "targets must be an integer"),
        (lambda: s2s(ids([1]), ids([1.0])), "tgt must be an integer tensor"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()


def test_padding_masks_are_checked_by_name_in_every_model():
    bert = BERT(BERTConfig(**CONFIGS[BERTConfig])).eval()
    x, longer = ids([1, 2, 3]), torch.ones(1, 4, dtype=torch.bool)
    as_ints = torch.ones(1, 3, dtype=torch.long)  # HF's attention_mask, not yet bool
    calls = {
        "valid": [
            lambda v: GPT_MODEL(x, valid=v),
            lambda v: GPT_MODEL.loss(x, x, valid=v),
            lambda v: bert(x, v),
        ],
        "src_valid": [lambda v: SEQ2SEQ(x, x, v), lambda v: SEQ2SEQ.encode(x, v)],
        "tgt_valid": [lambda v: SEQ2SEQ(x, x, None, v)],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(TypeError, match=rf"{name} must be a bool tensor .*\.bool\(\)"):
                fn(as_ints)
            with pytest.raises(ValueError, match=rf"{name} \(1, 4\) must have the shape of"):
                fn(longer)
    with pytest.raises(ValueError, match=r"valid describes ids alone, but offset=2"):
        GPT_MODEL(x, valid=torch.ones(1, 3, dtype=torch.bool), offset=2)


def test_images_of_the_wrong_kind_or_shape_name_images():
    vit, detr = ViT(ViTConfig.preset("tiny")).eval(), DETR(DETRConfig()).eval()
    with pytest.raises(TypeError, match=r"images .*torch.float64.*torch.float32"):
        vit(torch.rand(1, 1, 8, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"images must be a float tensor .* got list"):
        vit([[0.0]])
    with pytest.raises(TypeError, match=r"images must be a float tensor .* got Tensor torch.uint8"):
        detr(torch.zeros(1, 3, 64, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"images must have shape \(B, 3, 64, 64\), got \(3, 64"):
        detr(torch.rand(3, 64, 64))
    with pytest.raises(TypeError, match=r"images .*torch.float64.*torch.float32"):
        detr(torch.rand(1, 3, 64, 64, dtype=torch.float64))


# --- 3. generation arguments ----------------------------------------------------------------------

bad_seed = (st.integers(max_value=-1) | st.integers(min_value=2**64)).map(lambda v: (v, ValueError))
GENERATE_ARGS = {  # argument → bad values of it
    "max_new_tokens": bad_size(at_least=0),
    "temperature": bad_float(0.0),
    "top_k": bad_size(optional=True),
    "top_p": bad_float(0.0, 1.0, low_open=True, optional=True),
    "eos_id": bad_id(V, optional=True),
    "pad_id": bad_id(V),
    "seed": st.one_of(bad_seed, floats, flags),
}


@pytest.mark.parametrize("argument", list(GENERATE_ARGS))
@given(data=st.data())
def test_generate_arguments_are_checked_by_name(argument, data):
    value, error = data.draw(GENERATE_ARGS[argument])
    kwargs = {"max_new_tokens": 3, argument: value}
    raises_naming(argument, error, lambda: generate(GPT_MODEL, [[1, 2]], **kwargs))


@pytest.mark.parametrize(
    ("argument", "value", "error"),
    [
        ("max_new_tokens", 2.0, TypeError),
        ("bos_id", TGT_V, ValueError),
        ("eos_id", -1, ValueError),
        ("pad_id", SRC_V, ValueError),  # pads the sources
        ("temperature", math.nan, ValueError),
        ("top_k", 0, ValueError),
        ("top_p", 1.5, ValueError),
        ("seed", 2**64, ValueError),
    ],
)
def test_seq2seq_generate_arguments_are_checked_by_name(argument, value, error):
    kwargs = {"max_new_tokens": 3, "bos_id": 1, argument: value}
    raises_naming(argument, error, lambda: SEQ2SEQ.generate([[1, 2]], **kwargs))


@pytest.mark.parametrize("argument", ["temperature", "top_k", "top_p", "seed"])
@given(data=st.data())
def test_seq2seq_sampling_arguments_are_checked_as_gpts_are(argument, data):
    value, error = data.draw(GENERATE_ARGS[argument])
    kwargs = {"max_new_tokens": 3, "bos_id": 1, argument: value}
    raises_naming(argument, error, lambda: SEQ2SEQ.generate([[1, 2]], **kwargs))


@pytest.mark.parametrize(
    ("prompts", "error", "message"),
    [
        ([1, 2], TypeError, r"prompts\[0\] is the token id 1.*\[\[1, 2\]\], not \[1, 2\]"),
        ([[1, [2]]], TypeError, r"prompts\[0\]\[1\] is \[2\] \(list\)"),
        ([[1], []], ValueError, r"prompts\[1\] is empty"),
        (np.array([[1, 2]]), TypeError, r"prompts must be .* got ndarray.*torch.as_tensor"),
        ("hello", TypeError, r"prompts must be .* got str"),
        (["ab"], TypeError, r"prompts\[0\] must be a list of int token ids, got str"),
        ([[True, 2]], TypeError, r"prompts\[0\]\[0\] is True \(bool\)"),
        (torch.tensor([1, 2]), ValueError, r"prompts must be an integer tensor \(B, T\)"),
    ],
    ids=["flat", "nested-deeper", "empty-prompt", "numpy", "string", "strings", "bool", "1-d"],
)
def test_badly_nested_prompts_say_what_is_wrong(prompts, error, message):
    for call in (
        lambda: GPT_MODEL.generate(prompts, 2),
        lambda: iter_generate(GPT_MODEL, prompts, 2),  # checked when called, not at next()
    ):
        with pytest.raises(error, match=message):
            call()


def test_a_prompt_past_the_context_names_its_length_the_context_and_what_fits():
    model = gpt(max_len=10)
    with pytest.raises(
        ValueError,
        match=r"the prompt has 6 tokens and max_new_tokens=5: 11 positions, past the model's "
        r"context of 10; at most 4 new tokens fit",
    ):
        model.generate([[1] * 6], 5)
    with pytest.raises(ValueError, match=r"prompt has 12 tokens, longer than .* context of 10"):
        model.generate([[1] * 12], 0)
    with pytest.raises(ValueError, match=r"src has 20 tokens .* past the model's context of 16"):
        SEQ2SEQ.generate([[1] * 20], 2, bos_id=1)
    with pytest.raises(
        ValueError,
        match=r"the target \(bos_id\) has 1 token and max_new_tokens=16: 17 positions, past the "
        r"model's context of 16; at most 15 new tokens fit",
    ):
        SEQ2SEQ.generate([[1, 2]], 16, bos_id=1)


# --- 4. dtype and device mismatches ---------------------------------------------------------------


def test_an_input_of_another_dtype_names_the_input_and_both_dtypes():
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    mha = MultiHeadAttention(16, 2, context_dim=8)
    layers = {
        "MultiHeadAttention": lambda: mha(x),
        "Block": lambda: Block(BlockConfig(d_model=16, n_heads=2))(x),
        "LayerNorm": lambda: LayerNorm(16)(x),
        "MLP": lambda: MLP(16)(x),
    }
    for layer, call in layers.items():
        with pytest.raises(TypeError, match=rf"{layer} got x of dtype torch.float64.*float32"):
            call()
    with pytest.raises(TypeError, match=r"got context of dtype torch.float64"):
        mha(x.float(), torch.randn(1, 2, 8, dtype=torch.float64))


def test_an_input_on_another_device_names_both_devices():
    x = torch.empty(1, 3, 16, device="meta")
    for layer in (MultiHeadAttention(16, 2), LayerNorm(16), MLP(16)):
        with pytest.raises(ValueError, match=r"got x on meta, but its weights are on cpu"):
            layer(x)
    with pytest.raises(ValueError, match=r"ids is on meta, but the model's weights are on cpu"):
        GPT_MODEL(ids([1, 2]).to("meta"))


def test_mixed_dtypes_stay_allowed_where_they_are_legitimate():
    block = Block(BlockConfig(d_model=16, n_heads=2))
    x = torch.randn(1, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's bf16 path
        assert block(x.bfloat16()).shape == (1, 3, 16)
        assert GPT_MODEL.loss(ids([1, 2, 3]), ids([2, 3, -100])).isfinite()
    assert LayerNorm(16)(x.bfloat16()).dtype == torch.bfloat16  # F.layer_norm's mixed kernel
