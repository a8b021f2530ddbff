"""The sandbox a chat template renders in, and the bounds on a render's work.

A chat template is code from a model's files. Jinja's sandbox
(https://jinja.palletsprojects.com/en/stable/sandbox/) keeps it away from Python's internals,
but not from running forever or filling the memory: ``{% for i in range(100000) %}{% for j in
range(100000) %}…`` is ten billion iterations, ``{{ 'a' * 10**10 }}`` ten gigabytes. Here a
render is bounded in three ways, each a keyword of
:func:`~dikkat.pretrained.chat_template.render_chat` (its module holds the defaults):

* ``max_steps`` — a *step* is one iteration of a ``{% for %}`` loop, one call (a macro, a method,
  a global), one filter, one ``+ * ** %`` operation, one ``~`` concatenation, one chunk of
  output: whatever a template repeats passes through one of them;
* ``max_seconds`` — a wall-clock deadline, checked at every step;
* ``max_chars`` — the size (characters, or items) of every value a step makes and of the whole
  output. ``*``, ``**``, ``+`` and ``%`` check the size before they compute, a call or filter
  refuses an integer argument larger than ``max_chars`` (a width: ``center(10**9)``), and
  ``replace`` and ``join`` of a list check what they would make; other values are checked once
  made. Integers are held to ``MAX_INT_BITS``.

A template that recurses past Python's recursion limit ends in a ``RecursionError``, which
:func:`~dikkat.pretrained.chat_template.render_chat` reports in one line like the bounds.

The bounds are kept per render in a :class:`contextvars.ContextVar`, so one compiled template
serves renders in several threads at once, each with its own budget.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from functools import wraps
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.ext import loopcontrols
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["MAX_INT_BITS", "BoundedSandbox", "Budget", "TemplateLimitError"]

MAX_INT_BITS = 1 << 16  # an integer a template makes: 65 536 bits (19 729 digits) at most

# a conversion of % or str.format whose width or precision is a 7-digit number, or given by *
_WIDE_PERCENT = re.compile(r"%[^%a-zA-Z]*?(?:\*|\d{7})")
_WIDE_FORMAT = re.compile(r"\{[^{}]*:[^{}]*\d{7}[^{}]*\}")
# Jinja's filters whose integer arguments size what they make
_WIDTH_FILTERS = frozenset({"batch", "center", "indent", "slice", "truncate", "wordwrap"})


class TemplateLimitError(Exception):
    """A render ran past one of its bounds; the message names the bound and its value."""


class Budget:
    """The bounds of one render, and what it has spent."""

    __slots__ = ("chars", "deadline", "max_chars", "max_seconds", "max_steps", "steps")

    def __init__(self, *, max_seconds: float, max_steps: int, max_chars: int) -> None:
        self.max_seconds, self.max_steps, self.max_chars = max_seconds, max_steps, max_chars
        self.steps = 0
        self.chars = 0  # of output so far
        self.deadline = time.monotonic() + max_seconds

    def tick(self) -> None:
        self.steps = steps = self.steps + 1
        if steps > self.max_steps:
            raise TemplateLimitError(f"{self.max_steps:,} steps (max_steps)")
        # the clock every 16 steps: what runs between two steps is bounded (a few operations,
        # or one loop over at most MAX_RANGE items in a filter), and reading it costs a call
        if not steps & 15 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"{self.max_seconds:g} seconds (max_seconds)")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise TemplateLimitError(f"{self.max_chars:,} characters (max_chars) in {what}")

    def made(self, value: Any, what: str) -> Any:
        """``value`` after a check of its size, where it has one."""
        if isinstance(value, (str, list, tuple, dict)):
            self.size(len(value), what)
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"{MAX_INT_BITS:,} bits (MAX_INT_BITS) in {what}")
        return value

    def output(self, chunk: str) -> None:
        self.tick()
        self.chars += len(chunk)
        self.size(self.chars, "the rendered text")


_BUDGET: ContextVar[Budget | None] = ContextVar("dikkat_chat_template_budget", default=None)


def active_budget() -> ContextVar[Budget | None]:
    """Where a render keeps its :class:`Budget` (set around a render, reset after it)."""
    return _BUDGET


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every ``for`` loop's iterable passed through
    :meth:`BoundedSandbox.dikkat_iter` and every ``~`` through
    :meth:`BoundedSandbox.dikkat_concat`: the two places a template works without calling
    anything the sandbox sees."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:  # noqa: N802 (Jinja's name)
        # an attribute of the environment, which the template's code cannot reach or rebind
        guard = nodes.EnvironmentAttribute("dikkat_iter", lineno=node.lineno)
        node.iter = nodes.Call(guard, [node.iter], [], None, None, lineno=node.lineno)
        super().visit_For(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:  # noqa: N802
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)  # not how chat templates are rendered
            return
        self.write("environment.dikkat_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with a step taken (and sizes checked) at every hook it offers:
    calls, the operators ``+ * ** %``, every filter, and, through
    :class:`_BoundedCodeGenerator`, every loop iteration and ``~`` concatenation. Without a
    :class:`Budget` set (:func:`active_budget`) it is Jinja's sandbox."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(extensions=[loopcontrols], **options)

    def add_filters(self, filters: dict[str, Callable[..., Any]]) -> None:
        """Set ``filters`` (name → function), then put every filter of the environment, Jinja's
        own included, behind the budget."""
        self.filters.update(filters)
        for name, f in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, f)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        budget.tick()
        if operator == "+" and type(left) is str and type(right) is str:  # most of a template's
            budget.size(len(left) + len(right), "'+'")
            return left + right
        _check_binop(budget, operator, left, right)
        return budget.made(super().call_binop(context, operator, left, right), f"'{operator}'")

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _BUDGET.get()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.tick()
        _check_method(budget, getattr(__obj, "__wrapped__", __obj), args, kwargs)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        return budget.made(super().call(__context, __obj, *args, **kwargs), f"{name}()")

    def dikkat_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """A ``{% for %}`` loop's iterable, a step per item (the code generator puts every loop's
        iterable through it)."""
        budget = _BUDGET.get()
        if budget is None:
            yield from iterable
            return
        for item in iterable:
            budget.tick()
            yield item

    def dikkat_concat(self, parts: tuple[Any, ...]) -> str:
        """``a ~ b ~ …``: Jinja's ``str_join``, its size checked before it is made."""
        texts = [str(p) for p in parts]
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
            budget.size(sum(map(len, texts)), "'~'")
        return "".join(texts)


def _check_binop(budget: Budget, operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would pass the budget's sizes, before it is made."""
    what = f"'{operator}'"
    sized = (str, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sized):
            left, right = right, left
        if isinstance(left, sized) and isinstance(right, int):
            budget.size(len(left) * max(right, 0), what)
        elif isinstance(left, int) and isinstance(right, int):
            _bits(left.bit_length() + right.bit_length(), what)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _bits(right * abs(left).bit_length(), what)
    elif operator == "+":
        if isinstance(left, sized) and isinstance(right, sized):
            budget.size(len(left) + len(right), what)
    elif operator == "%" and isinstance(left, str) and _WIDE_PERCENT.search(left):
        raise TemplateLimitError(f"{budget.max_chars:,} characters (max_chars) in '%': a width")


def _bits(bits: int, what: str) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateLimitError(f"{MAX_INT_BITS:,} bits (MAX_INT_BITS) in {what}")


def _check_arguments(budget: Budget, name: str, args: tuple[Any, ...], kwargs: dict) -> None:
    """Refuse an integer argument past ``max_chars``: a width or a count (``center(10**9)``)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and abs(value) > budget.max_chars:
            raise TemplateLimitError(
                f"{budget.max_chars:,} characters (max_chars): {name} was given {value}"
            )


def _check_method(budget: Budget, method: Any, args: tuple[Any, ...], kwargs: dict) -> None:
    """A method of a str (``center``, ``replace``, ``join``, ``format``, …), refused before its
    result would pass the sizes."""
    text = getattr(method, "__self__", None)
    if not isinstance(text, str):
        return
    name = getattr(method, "__name__", "")
    _check_arguments(budget, f"str.{name}()", args, kwargs)
    if name == "replace":
        _check_replace(budget, text, *args[:3])
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        _check_join(budget, text, args[0])
    elif name in ("format", "format_map") and _WIDE_FORMAT.search(text):
        raise TemplateLimitError(
            f"{budget.max_chars:,} characters (max_chars) in format(): a width"
        )


def _check_replace(
    budget: Budget, text: Any, old: Any = None, new: Any = None, count: Any = -1
) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        n = text.count(old) if not isinstance(count, int) or count < 0 else count
        budget.size(len(text) + n * max(len(new) - len(old), 0), "replace()")


def _check_join(budget: Budget, sep: str, items: list | tuple) -> None:
    total = len(sep) * max(len(items) - 1, 0) + sum(len(x) for x in items if isinstance(x, str))
    budget.size(total, "join()")


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Filter ``f`` taking a step, checking its arguments (``replace`` and ``join`` what they
    would make) and the size of its result. ``wraps`` keeps Jinja's marks on ``f``
    (``pass_eval_context``, …), which say what it is passed first."""
    if getattr(f, "dikkat_bounded", False):
        return f
    widths = name in _WIDTH_FILTERS
    # the value is the first argument, or the second after a context or environment
    first = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is None:
            return f(*args, **kwargs)
        budget.tick()
        if widths:
            _check_arguments(budget, f"the {name} filter", args, kwargs)
        value = args[first:]
        if name == "replace" and len(value) >= 3:
            _check_replace(budget, *value[:4])
        elif name == "join" and value and isinstance(value[0], (list, tuple)):
            sep = value[1] if len(value) > 1 else kwargs.get("d", "")
            if isinstance(sep, str) and len(value) < 3 and "attribute" not in kwargs:
                _check_join(budget, sep, value[0])
        return budget.made(f(*args, **kwargs), f"the {name} filter")

    bounded.dikkat_bounded = True  # type: ignore[attr-defined]
    return bounded
