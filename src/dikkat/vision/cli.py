"""The vision commands of ``dikkat`` (each command's parser is added by one function here)."""

from __future__ import annotations

from typing import Any


def add_vision_commands(sub: Any) -> None:
    """Register the vision subcommands on the top-level ``dikkat`` parser's subparsers."""
