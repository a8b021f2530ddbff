"""What a generated text must match: a JSON Schema, a regular expression, one of a few strings,
or a context-free grammar (:class:`Constraint`, a field of
:class:`~dikkat.generation.SamplingParams`), and how a decoder is held to it.

A constraint is compiled against a tokenizer's vocabulary by llguidance
(https://github.com/guidance-ai/llguidance, the grammar engine behind vLLM's and llama.cpp's
``llguidance`` backends): at each step it gives, for each row, the set of tokens that keep the
text a prefix of some text the constraint accepts, as a bitmask of 32 tokens a word
(:class:`Grammars`, :class:`Guide`). The disallowed tokens' logits become −inf before anything
else touches them, so greedy picks, draws, penalties and log-probabilities all see only what
the constraint allows; once the text is complete only the end-of-text tokens are allowed.

JSON is generated in one layout: ``", "`` between items, ``": "`` after keys, no other
whitespace (llguidance's ``whitespace_flexible`` off). Flexible whitespace lets a small model
write newlines for ever without breaking the grammar (vLLM's ``disable-any-whitespace`` exists
for the same reason).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from dikkat.validate import check_int

__all__ = [
    "CONSTRAINTS",
    "JSON_LAYOUT",
    "KEPT_GRAMMARS",
    "Constraint",
    "ConstraintError",
    "Grammars",
    "Guide",
    "constraint_of",
    "mask_logits",
    "matcher_of",
    "missing_grammars",
    "take",
]

CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")  # SamplingParams' fields
KEPT_GRAMMARS = 256  # compiled constraints a Grammars keeps, the least recently used dropped
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint the grammar engine cannot compile (an unsupported JSON Schema feature, a
    malformed regular expression or grammar); the message names the field and the reason."""


@dataclass(frozen=True)
class Constraint:
    """One of :data:`CONSTRAINTS` (``kind``) and its value in normal form: a JSON Schema as
    compact JSON text (its keys in their order: an object's properties are generated in the
    order the schema lists them), a regex or grammar as given, a choice as a tuple of
    strings."""

    kind: str
    value: str | tuple[str, ...]

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint (its JSON text)."""
        return _grammar_text(self.kind, self.value)


def constraint_of(fields: Mapping[str, Any]) -> Constraint | None:
    """The constraint among ``fields`` (the values of :data:`CONSTRAINTS`; None or ``()`` when
    unset), checked and in normal form; None if none is set. Two or more is a ``ValueError``."""
    given = {k: v for k, v in fields.items() if v is not None and not _empty_choice(k, v)}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give one constraint at most, got {', '.join(sorted(given))}")
    ((kind, value),) = given.items()
    if kind == "json_schema":
        return Constraint(kind, _schema_text(value))
    if kind == "choice":
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"choice must be a list of strings, got {type(value).__name__}")
        if not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"choice must hold non-empty strings, got {list(value)!r}")
        return Constraint(kind, tuple(value))
    if not isinstance(value, str) or not value:
        raise TypeError(f"{kind} must be a non-empty str, got {value!r}")
    return Constraint(kind, value)


def _empty_choice(kind: str, value: object) -> bool:
    return kind == "choice" and isinstance(value, (tuple, list)) and not value


def _schema_text(schema: object) -> str:
    """A JSON Schema given as a dict, its JSON text or a pydantic model class → compact JSON.
    A pydantic model's objects take no properties they do not name (``additionalProperties``
    false where unset), as the ``openai`` client's ``parse`` sends them: the text then parses
    into the model, and a model cannot add keys until it runs out of tokens."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model
        schema = _closed(schema.model_json_schema())
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise TypeError(
            f"json_schema must be a JSON Schema (a dict, its JSON text or a pydantic model "
            f"class), got {type(schema).__name__}"
        )
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema cannot be written as JSON: {e}") from None


_NAMED = ("properties", "$defs", "definitions", "patternProperties")  # name → schema maps


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` in every object that lists properties
    and does not say (a map of names to schemas is not a schema: a property may be called
    "properties")."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: {n: _closed(v) for n, v in sub.items()}
        if k in _NAMED and isinstance(sub, dict) else _closed(sub)
        for k, sub in schema.items()
    }  # fmt: skip
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _grammar_text(kind: str, value: str | tuple[str, ...]) -> str:
    llg = _llguidance()
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(value, overrides=JSON_LAYOUT)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(list(value)))
    try:
        return llg.grammar_from("grammar", value)  # Lark, or GBNF (converted to Lark)
    except ValueError as e:
        raise ConstraintError(f"grammar: {e}") from None


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError(
            "constrained decoding (json_schema, regex, choice, grammar) needs llguidance: "
            "pip install 'dikkat[structured]'"
        ) from None
    return llguidance


class Grammars:
    """Compiles constraints against one vocabulary, and keeps what it compiled: the
    vocabulary's llguidance tokenizer (about a second to build, once) and the checked grammars
    of the last :data:`KEPT_GRAMMARS` constraints (so a schema sent again costs nothing to
    compile, and a server sent ever new ones holds a bounded number).

    ``tokenizer`` is a ``tokenizers.Tokenizer``, or an object holding one as ``backend``
    (:class:`dikkat.pretrained.Tokenizer`) or ``inner`` (:class:`dikkat.text.HFTokenizer`);
    or ``None`` with ``token_bytes``, every id's bytes (dikkat's byte tokenizer).
    ``vocab_size`` is the model's (ids past the tokenizer's are never allowed); ``eos_ids``
    the ids that end a text, allowed once it is complete."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: Iterable[int],
        *,
        token_bytes: Sequence[bytes] | None = None,
    ) -> None:
        llg = _llguidance()
        check_int("vocab_size", vocab_size)
        eos = sorted(int(i) for i in eos_ids)
        if not eos:
            raise ValueError("constrained decoding needs an end-of-text id (eos_ids is empty)")
        if eos[-1] >= vocab_size:
            raise ValueError(f"eos_ids={eos} hold an id outside the vocabulary of {vocab_size}")
        backend = _backend(tokenizer)
        if backend is not None:
            spec: Any = backend.to_str()
        elif token_bytes is not None:
            spec = llg.TokenizerWrapper(_Listed(token_bytes, eos[0]))
        else:
            raise TypeError(
                f"constrained decoding needs a tokenizers-based tokenizer or token_bytes, got "
                f"{type(tokenizer).__name__}"
            )
        self.vocab_size, self.eos_ids = int(vocab_size), tuple(eos)
        self.tokenizer = llg.LLTokenizer(spec, n_vocab=self.vocab_size, eos_token=eos)
        self._checked: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> str:
        """The checked grammar of ``constraint``; a :class:`ConstraintError` names what the
        engine could not compile."""
        with self._lock:
            found = self._checked.get(constraint)
            if found is not None:
                self._checked.move_to_end(constraint)
                return found
        grammar = constraint.grammar_text()
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ConstraintError(f"{constraint.kind}: {messages[0]}")
        with self._lock:
            self._checked[constraint] = grammar
            while len(self._checked) > KEPT_GRAMMARS:
                self._checked.popitem(last=False)
        return grammar

    def guide(self, constraints: Sequence[Constraint | None]) -> Guide:
        """A :class:`Guide` for rows held to ``constraints`` (None: a free row)."""
        return Guide([None if c is None else self.matcher(c) for c in constraints])

    def matcher(self, constraint: Constraint) -> Any:
        """A new llguidance matcher of ``constraint``, at the start of its text."""
        return _llguidance().LLMatcher(self.tokenizer, self.compile(constraint))


def matcher_of(grammars: Grammars | None, constraint: Constraint | None, where: str) -> Any:
    """A new matcher of ``constraint`` (None: None), compiled by ``grammars``; without them a
    ``ValueError`` that says to pass them ``where``."""
    if constraint is None:
        return None
    if grammars is None:
        raise missing_grammars(constraint, where)
    return grammars.matcher(constraint)


def missing_grammars(constraint: Constraint, where: str) -> ValueError:
    """The error of a constraint given where no :class:`Grammars` is (``where``: how to pass
    one)."""
    return ValueError(
        f"{constraint.kind} needs the tokenizer's vocabulary to hold the text to: pass {where} "
        "(dikkat.generation.Grammars(tokenizer, vocab_size, eos_ids)), or generate through "
        "dikkat.pretrained (Pretrained.generate / chat) or the server"
    )


def mask_logits(logits: Tensor, held: Sequence[tuple[Any, int]]) -> Tensor:
    """``logits`` (B, V) in fp32 with the tokens each held row's matcher forbids at −inf (a new
    tensor; ``held``: (matcher, row) pairs, matchers of :meth:`Grammars.matcher` over a
    vocabulary of V). Several rows' bitmasks are computed together on llguidance's threads
    (one row's on this one: a pool's threads would wait beside torch's), and applied as one
    tensor operation; the other rows are left as they are."""
    if not held:
        return logits
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must be floating-point (B, V), got {got}")
    B, V = logits.shape
    if any(not 0 <= row < B for _, row in held):
        raise ValueError(f"held rows {[r for _, r in held]} must be rows of the {B} logits")
    words = (V + 31) // 32
    bits = torch.full((B, words), -1, dtype=torch.int32)
    if len(held) == 1:
        matcher, row = held[0]
        matcher.unsafe_compute_mask_ptr(bits[row].data_ptr(), words * 4)
    else:
        _executor().unsafe_compute_mask_ptr(list(held), bits.data_ptr(), words * 4, B)
    # bit j of byte i is token 8 i + j (the words are little-endian)
    forbidden = (bits.view(torch.uint8).unsqueeze(-1) & _BITS).view(B, -1)[:, :V] == 0
    return torch.where(forbidden.to(logits.device), float("-inf"), logits.float())


@lru_cache(maxsize=1)
def _executor() -> Any:
    """llguidance's thread pool, as many threads as torch's."""
    return _llguidance().LLExecutor(num_threads=max(1, torch.get_num_threads()))


_BITS = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)  # a byte's 8 bits


def take(matcher: Any, token: int) -> None:
    """``matcher`` takes ``token``; one whose text is complete takes nothing more (the stop
    token that follows, repeated by a batch's finished rows). A token it forbids (only a
    logit it never masked could be one) raises."""
    if not matcher.is_stopped() and not matcher.consume_token(int(token)):
        raise RuntimeError(f"token {token} left the constraint: {matcher.get_error()}")


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` of ``tokenizer``, or None."""
    for name in ("", "backend", "inner"):
        candidate = getattr(tokenizer, name, None) if name else tokenizer
        if hasattr(candidate, "to_str") and hasattr(candidate, "id_to_token"):
            return candidate
    return None


class _Listed:
    """A vocabulary listed as bytes, in the shape llguidance's ``TokenizerWrapper`` reads."""

    def __init__(self, tokens: Sequence[bytes], eos: int) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = list(tokens), eos, None
        self._ids = {t: i for i, t in enumerate(self.tokens)}

    def __call__(self, text: bytes) -> list[int]:  # byte by byte: the byte tokenizer's ids
        return [self._ids[bytes([b])] for b in text]


class Guide:
    """The matchers of a batch of rows decoded together (None for a free row): :meth:`mask`
    applies them to the rows' logits, :meth:`advance` feeds each row the token it took."""

    def __init__(self, matchers: Sequence[Any]) -> None:
        self.matchers = list(matchers)

    def mask(self, logits: Tensor) -> Tensor:
        """:func:`mask_logits` of the held rows."""
        if logits.shape[0] != len(self.matchers):
            raise ValueError(
                f"logits hold {logits.shape[0]} rows for a guide of {len(self.matchers)}"
            )
        held = [(m, row) for row, m in enumerate(self.matchers) if m is not None]
        return mask_logits(logits, held)

    def advance(self, tokens: Sequence[int]) -> None:
        """Each held row takes its token (``tokens`` one per row, in row order); a row whose
        text is complete takes nothing more (its end-of-text token, repeated by the loop)."""
        for row, m in enumerate(self.matchers):
            if m is not None:
                take(m, tokens[row])
