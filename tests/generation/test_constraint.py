"""Constrained decoding (dikkat.generation.constraint): every text a constrained decoder makes
matches its constraint, whatever the model; the bitmask is the grammar engine's own, token by
token; free rows are untouched."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dikkat.generation import SamplingParams, generate
from dikkat.generation.constraint import ConstraintError, Grammars, mask_logits
from dikkat.models import GPT, GPTConfig
from dikkat.serving import Engine

EOS = 1  # the tiny tokenizer's </s>


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE: <s>, </s>, the 256 byte tokens and a few merges (tokens of two and
    three letters, as real vocabularies have)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": EOS} | {ch: i + 2 for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2"), ('"', ":")]
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(merges)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(tokenizer, 300, [EOS])


def tiny_model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=300, max_len=256, d_model=32, n_layers=1, n_heads=2)).eval()


def text_of(tokenizer: Tokenizer, ids: list[int], prompt: int) -> str:
    new = ids[prompt:]
    assert new and new[-1] == EOS, "a constrained text ends with the end-of-text token"
    return tokenizer.decode(new[:-1])


def run(model: GPT, grammars: Grammars, params: SamplingParams) -> list[list[int]]:
    return generate(model, [[2, 3, 4]], params, grammars=grammars)


# --- the parameters ---------------------------------------------------------------------------


class Point(BaseModel):
    x: int
    label: str


class Shape(BaseModel):
    properties: dict[str, int]
    corner: Point


def test_schemas_in_normal_form() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    as_text = SamplingParams(json_schema=json.dumps(schema, indent=2))
    assert as_text == SamplingParams(json_schema=schema)
    assert json.loads(as_text.json_schema) == schema
    assert list(json.loads(as_text.json_schema)["properties"]) == ["b", "a"]  # order kept
    closed = Point.model_json_schema() | {"additionalProperties": False}  # as openai's parse
    assert json.loads(SamplingParams(json_schema=Point).json_schema) == closed
    # nested models too, and a field called "properties" is a field, not a schema's keyword
    nested = json.loads(SamplingParams(json_schema=Shape).json_schema)
    assert nested["additionalProperties"] is False
    assert nested["$defs"]["Point"]["additionalProperties"] is False
    assert set(nested["properties"]) == {"properties", "corner"}
    assert SamplingParams(choice=["a", "b"]).constraint.value == ("a", "b")
    assert SamplingParams().constraint is None and SamplingParams(choice=()).constraint is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": 3}, "json_schema must be a JSON Schema"),
        ({"regex": ""}, "regex must be a non-empty str"),
        ({"choice": "ab"}, "choice must be a list of strings"),
        ({"choice": ["a", ""]}, "choice must hold non-empty strings"),
        (
            {"regex": "a", "grammar": "root ::= 'a'"},
            "give one constraint at most, got grammar, regex",
        ),
        (
            {"regex": "a+", "min_new_tokens": 2, "stop_ids": (1,), "max_new_tokens": 4},
            "min_new_tokens=2 and regex cannot both hold",
        ),
    ],
)
def test_bad_constraints_are_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        SamplingParams(**fields)


def test_compile_errors_name_the_field(grammars: Grammars) -> None:
    with pytest.raises(ConstraintError, match=r"^json_schema: .*foo"):
        grammars.compile(SamplingParams(json_schema={"type": "foo"}).constraint)
    with pytest.raises(ConstraintError, match=r"^regex: "):
        grammars.compile(SamplingParams(regex="a(b").constraint)
    with pytest.raises(ConstraintError, match=r"^grammar: "):
        grammars.compile(SamplingParams(grammar="root ::= (").constraint)


def test_a_constraint_needs_a_vocabulary() -> None:
    with pytest.raises(ValueError, match="regex needs the tokenizer's vocabulary"):
        run(tiny_model(0), None, SamplingParams(regex="a+", stop_ids=(EOS,)))  # type: ignore[arg-type]


# --- the mask ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3])
def test_mask_is_the_matchers_own(grammars: Grammars, tokenizer: Tokenizer, rows: int) -> None:
    """Token by token along a text, the allowed set of each held row is exactly the tokens its
    matcher accepts one at a time (one row: its mask made on this thread; several: on
    llguidance's pool); a free row in the same batch is untouched."""
    constraint = SamplingParams(json_schema={"type": "array", "items": {"type": "integer"}})
    matchers = [grammars.matcher(constraint.constraint) for _ in range(rows)]
    text = [*tokenizer.encode("[12, -3]", add_special_tokens=False).ids, EOS]
    for step, token in enumerate(text):
        logits = torch.randn(rows + 1, 300, dtype=torch.float64)
        held = [(m, r + 1) for r, m in enumerate(matchers)]
        masked = mask_logits(logits, held)
        assert masked.dtype == torch.float32
        torch.testing.assert_close(masked[0], logits[0].float(), rtol=0, atol=0)
        for m, r in held:
            allowed = set(torch.isfinite(masked[r]).nonzero().flatten().tolist())
            # (the end-of-text token: allowed where the text may end)
            accepts = {t for t in range(300) if t != EOS and m.validate_tokens([t]) == 1}
            accepts |= {EOS} if m.is_accepting() else set()
            assert allowed == accepts and token in allowed, step
            kept = masked[r][sorted(allowed)]
            torch.testing.assert_close(kept, logits[r, sorted(allowed)].float(), rtol=0, atol=0)
        for m in matchers:
            assert m.consume_token(token)
    assert all(m.is_stopped() for m in matchers)


# --- what comes out ---------------------------------------------------------------------------

_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
)


def _objects(children: st.SearchStrategy) -> st.SearchStrategy:
    names = st.text("abcdefgh", min_size=1, max_size=4)
    return st.dictionaries(names, children, min_size=1, max_size=3).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    )


def _arrays(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(
        lambda items, most: {"type": "array", "items": items, "maxItems": most},
        children,
        st.integers(0, 3),
    )


SCHEMAS = st.recursive(_LEAVES, lambda c: st.one_of(_objects(c), _arrays(c)), max_leaves=5)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=SCHEMAS, seed=st.integers(0, 3), temperature=st.sampled_from([0.0, 1.0, 2.0]))
def test_every_output_validates(
    grammars: Grammars, tokenizer: Tokenizer, schema: dict, seed: int, temperature: float
) -> None:
    """Random schemas of the subset, random models, greedy and drawn: every text is JSON that
    validates against its schema (jsonschema)."""
    params = SamplingParams(
        max_new_tokens=240, temperature=temperature, seed=seed, stop_ids=(EOS,), json_schema=schema
    )
    (ids,) = run(tiny_model(seed), grammars, params)
    text = text_of(tokenizer, ids, 3)
    jsonschema.validate(json.loads(text), schema)
    assert text == json.dumps(json.loads(text), ensure_ascii=False), "the one compact layout"


@pytest.mark.parametrize("seed", range(3))
def test_regex_choice_and_grammar(grammars: Grammars, tokenizer: Tokenizer, seed: int) -> None:
    model = tiny_model(seed)
    cases = [
        (dict(regex=r"[a-c]{2,4}-\d\d"), lambda t: re.fullmatch(r"[a-c]{2,4}-\d\d", t)),
        (dict(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        # GBNF, llama.cpp's grammar format: a list of small numbers
        (
            dict(grammar='root ::= "[" num ("," num){0,2} "]"\nnum ::= [0-9]'),
            lambda t: re.fullmatch(r"\[\d(,\d){0,2}\]", t),
        ),
    ]
    for fields, check in cases:
        for temperature in (0.0, 1.5):
            params = SamplingParams(
                max_new_tokens=40, temperature=temperature, seed=seed, stop_ids=(EOS,), **fields
            )
            text = text_of(tokenizer, run(model, grammars, params)[0], 3)
            assert check(text), (fields, text)


def test_batched_rows_each_held(grammars: Grammars, tokenizer: Tokenizer) -> None:
    """Rows of one batch (padded prompts, n choices) are each held to the constraint."""
    params = SamplingParams(
        max_new_tokens=30, temperature=1.0, seed=1, n=3, stop_ids=(EOS,), regex=r"\d{1,3}"
    )
    prompts = [[5, 6, 7, 8], [9]]
    rows = generate(tiny_model(1), prompts, params, grammars=grammars)
    for k, ids in enumerate(rows):
        assert re.fullmatch(r"\d{1,3}", text_of(tokenizer, ids, len(prompts[k // 3])))


def test_engine_mixes_free_and_held_rows(grammars: Grammars, tokenizer: Tokenizer) -> None:
    """In the serving engine, a constrained request beside a free one: the free one's tokens
    are those it makes alone, and the held one's text validates."""
    model = tiny_model(2)
    free = SamplingParams(max_new_tokens=24, temperature=0.9, seed=4)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    held = SamplingParams(max_new_tokens=40, temperature=0.9, seed=5, stop_ids=(EOS,),
                          json_schema=schema)  # fmt: skip

    def tokens(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
        ids = [engine.submit(prompt, params) for prompt, params in jobs]
        out: dict[int, list[int]] = {i: [] for i in ids}
        for _ in range(200):
            if not engine.has_work():
                break
            for event in engine.step():
                assert event.error is None, event.error
                if event.token is not None:
                    out[event.request_id].append(event.token)
        return [out[i] for i in ids]

    (alone,) = tokens(Engine(model, block_size=4), [([7, 8, 9], free)])
    together = tokens(Engine(model, block_size=4, grammars=grammars), [([7, 8, 9], free),
                      ([10, 11], held)])  # fmt: skip
    assert together[0] == alone
    jsonschema.validate(json.loads(text_of(tokenizer, [0, *together[1]], 1)), schema)
    with pytest.raises(ValueError, match=r"json_schema needs .* Engine\(grammars="):
        Engine(model, block_size=4).submit([1, 2], held)


def test_a_byte_vocabulary_listed_by_its_bytes() -> None:
    """A tokenizer with no ``tokenizers`` behind it (dikkat's byte tokenizer: id = byte) is
    given as each id's bytes; id 0 ends the text."""
    grammars = Grammars(None, 256, [0], token_bytes=[bytes([i]) for i in range(256)])
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=256, max_len=64, d_model=32, n_layers=1, n_heads=2)).eval()
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=2, stop_ids=(0,),
                            regex=r"[a-z]{2,5}=\d")  # fmt: skip
    (ids,) = generate(model, [[65, 66]], params, grammars=grammars)
    assert ids[-1] == 0 and re.fullmatch(r"[a-z]{2,5}=\d", bytes(ids[2:-1]).decode())


def test_the_compiled_grammars_kept_are_bounded(monkeypatch) -> None:
    import dikkat.generation.constraint as constraint_module

    monkeypatch.setattr(constraint_module, "KEPT_GRAMMARS", 2)
    kept = Grammars(None, 256, [0], token_bytes=[bytes([i]) for i in range(256)])
    for n in range(4):
        kept.compile(SamplingParams(regex=f"a{{{n + 1}}}").constraint)
    assert [c.value for c in kept._checked] == ["a{3}", "a{4}"]  # the last two, in use order


def test_bad_arguments_are_named(grammars: Grammars, tokenizer: Tokenizer) -> None:
    matcher = grammars.matcher(SamplingParams(regex="a+").constraint)
    with pytest.raises(ValueError, match=r"logits must be floating-point \(B, V\), got \(300,\)"):
        mask_logits(torch.zeros(300), [(matcher, 0)])
    with pytest.raises(ValueError, match=r"held rows \[2\] must be rows of the 2 logits"):
        mask_logits(torch.zeros(2, 300), [(matcher, 2)])
    with pytest.raises(ValueError, match="eos_ids is empty"):
        Grammars(tokenizer, 300, [])
    with pytest.raises(ValueError, match=r"eos_ids=\[300\] hold an id outside the vocabulary"):
        Grammars(tokenizer, 300, [300])
    with pytest.raises(TypeError, match="tokenizers-based tokenizer or token_bytes, got int"):
        Grammars(3, 300, [1])
