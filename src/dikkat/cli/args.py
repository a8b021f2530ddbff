"""argparse value types: each rejects a bad value with one clear line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def _number(text: str, convert: Callable[[str], N], ok: Callable[[N], bool], what: str) -> N:
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def probability(text: str) -> float:
    """argparse type: a float in (0, 1]."""
    return _number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def non_negative_float(text: str) -> float:
    """argparse type: a number ≥ 0."""
    return _number(text, float, lambda v: v >= 0, "a number ≥ 0")


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    return _number(text, float, lambda v: v > 0, "a positive number")


def add_no_verify(parser: argparse.ArgumentParser) -> None:
    """The ``--no-verify`` flag of every command that loads a saved model or run."""
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip checking the saved files against their SHA-256 (faster for a large model)",
    )
