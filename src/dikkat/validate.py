"""Checks for single values (config fields, sizes, probabilities): each error names the value.

A wrong kind of value (a float where a size goes, a bool where a number goes, a string) raises
``TypeError``; a value of the right kind outside its range raises ``ValueError``. Both messages
name the field and repeat what was given, e.g. ``n_layers must be a positive int, got 0``.

``bool`` is an ``int`` in Python; these checks refuse it where a number is meant, so that
``GPTConfig(n_layers=True)`` is an error, not a one-layer model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any


def is_int(value: object) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _kind(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int_range(at_least: int | None, at_most: int | None) -> str:
    if at_least is not None and at_most is not None:
        return f"an int in [{at_least}, {at_most}]"
    if at_least == 1:
        return "a positive int"
    if at_least is not None:
        return f"an int ≥ {at_least}"
    if at_most is not None:
        return f"an int ≤ {at_most}"
    return "an int"


def check_int(
    name: str,
    value: Any,
    *,
    at_least: int | None = 1,
    at_most: int | None = None,
    optional: bool = False,
) -> int | None:
    """An int in [``at_least``, ``at_most``] (None: no bound; None passes when ``optional``);
    returns it as a Python int."""
    if value is None and optional:
        return None
    want = _int_range(at_least, at_most) + (" or None" if optional else "")
    if not is_int(value):
        raise TypeError(f"{name} must be {want}, got {_kind(value)}")
    if (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
        raise ValueError(f"{name} must be {want}, got {value}")
    return int(value)


def check_sizes(obj: object, *names: str) -> None:
    """Each named attribute of ``obj`` (a config's size fields) is a positive int."""
    for name in names:
        check_int(name, getattr(obj, name))


def check_float(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> float | None:
    """A finite real number in the interval given by ``low``/``high`` (open ends as named)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number{' or None' if optional else ''}, got {_kind(value)}"
        )
    x = float(value)
    too_low = low is not None and (x <= low if low_open else x < low)
    too_high = high is not None and (x >= high if high_open else x > high)
    if not math.isfinite(x) or too_low or too_high:
        raise ValueError(f"{name} must be {_interval(low, high, low_open, high_open)}, got {value}")
    return x


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"a finite number {'>' if low_open else '≥'} {low:g}"
    if high is not None:
        return f"a finite number {'<' if high_open else '≤'} {high:g}"
    return "finite"


def check_probability(name: str, value: Any) -> float:
    """A dropout-style probability in [0, 1)."""
    return check_float(name, value, low=0.0, high=1.0, high_open=True)  # type: ignore[return-value]


def check_choice(name: str, value: Any, choices: Iterable[object]) -> None:
    """``value`` is one of ``choices``."""
    options = tuple(choices)
    if value not in options:
        want = " or ".join(map(repr, options)) if len(options) == 2 else f"one of {options}"
        raise ValueError(f"{name} must be {want}, got {value!r}")


def check_bool(name: str, value: Any) -> bool:
    """A real ``bool`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_kind(value)}")
    return value
