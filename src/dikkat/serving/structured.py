"""Structured outputs in the server: a request's constraint (``response_format``, vLLM's
``structured_outputs`` and ``guided_*`` fields, llama-server's ``json_schema`` and ``grammar``;
:meth:`~dikkat.serving.protocol.Sampling.constraint`) compiled before the request reaches the
engine, so that a constraint the grammar engine refuses is a 400 naming the field and the
reason. The compiler (:class:`~dikkat.generation.constraint.Grammars`) is built at the first
constrained request — its tokenizer takes about a second — and handed to the engine, which
holds each constrained request's text to it (docs/server.md, "Structured outputs")."""

from __future__ import annotations

import threading
from typing import Any

from dikkat.generation.constraint import ConstraintError, Grammars, constraint_of
from dikkat.generation.sampling import SamplingParams
from dikkat.serving.refused import RequestError
from dikkat.serving.tokens import Vocabulary


def request_constraint(body: Any) -> tuple[dict[str, Any], str | None]:
    """The constraint a request (:class:`~dikkat.serving.protocol.Sampling`) sets, as
    ``SamplingParams``' fields (``{"json_schema": {...}}``, or ``{}``), and the request's field
    that set it. One at most: two fields that each set one are refused, as is a kind this server
    does not know."""
    found: list[tuple[str, str, Any]] = []  # (the request's field, the kind, its value)
    if body.response_format is not None:
        found += _response_format(body.response_format)
    if body.structured_outputs is not None:
        found += _structured_outputs(body.structured_outputs)
    guided = {"guided_json": "json_schema", "guided_regex": "regex"}
    guided |= {"guided_choice": "choice", "guided_grammar": "grammar"}
    guided |= {"json_schema": "json_schema", "grammar": "grammar"}
    for name, kind in guided.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, kind, value))
    if len(found) > 1:
        names = ", ".join(f[0] for f in found)
        raise RequestError(f"{names}: give one constraint at most", param=found[1][0])
    if not found:
        return {}, None
    name, kind, value = found[0]
    try:
        constraint = constraint_of({kind: value})
    except (TypeError, ValueError) as e:
        raise RequestError(f"{name}: {e}", param=name) from None
    return ({} if constraint is None else {kind: constraint.value}), name


def _response_format(spec: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object), ``json_schema`` (``{"json_schema": {"name", "schema", "strict"}}``)."""
    kind = spec.get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_schema", {"type": "object"})]
    if kind != "json_schema":
        raise RequestError(
            f"response_format type {kind!r} is not supported: 'text', 'json_object' or "
            "'json_schema'",
            param="response_format",
        )
    inner = spec.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
        raise RequestError(
            "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
            param="response_format",
        )
    return [("response_format", "json_schema", inner["schema"])]


_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _structured_outputs(spec: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """vLLM's ``structured_outputs`` object: ``json`` (a schema), ``regex``, ``choice``,
    ``grammar`` or ``json_object: true``."""
    found = []
    for key, value in spec.items():
        if value is None or value is False:
            continue
        if key == "json_object":
            found.append(("structured_outputs", "json_schema", {"type": "object"}))
        elif key in _STRUCTURED:
            found.append(("structured_outputs", _STRUCTURED[key], value))
        elif key not in ("backend", "disable_any_whitespace", "disable_fallback"):
            raise RequestError(
                f"structured_outputs.{key} is not supported: json, regex, choice, grammar or "
                "json_object",
                param="structured_outputs",
            )
    return found


class ServedGrammars:
    """The server's constraint compiler over ``vocab``, given to ``engine`` when made."""

    def __init__(self, engine: Any, vocab: Vocabulary) -> None:
        self._engine, self._vocab = engine, vocab
        self._grammars: Grammars | None = getattr(engine, "grammars", None)
        self._lock = threading.Lock()

    def check(self, params: SamplingParams, param: str | None) -> None:
        """Compile ``params.constraint`` (cached per constraint), or refuse the request: a
        :class:`RequestError` for ``param``, the field that set it."""
        if params.constraint is None:
            return
        try:
            self._get().compile(params.constraint)
        except (ConstraintError, ValueError, TypeError, ImportError) as e:
            raise RequestError(f"{param}: {e}", param=param) from None

    def _get(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                vocab = self._vocab
                listed = None
                if not hasattr(vocab.tokenizer, "backend") and not hasattr(
                    vocab.tokenizer, "inner"
                ):
                    listed = [vocab.token_bytes(i) for i in range(vocab.known)]
                self._grammars = Grammars(
                    vocab.tokenizer, vocab.vocab_size, vocab.eos_ids, token_bytes=listed
                )
                if hasattr(self._engine, "grammars"):
                    self._engine.grammars = self._grammars
            return self._grammars
