"""Named configurations: one lookup shared by every frozen config dataclass."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

C = TypeVar("C")


def pick_preset(presets: dict[str, C], name: str, what: str, overrides: dict[str, object]) -> C:
    """``presets[name]`` with some fields replaced; a clear error for an unknown name."""
    if name not in presets:
        raise ValueError(f"unknown {what} preset {name!r}; choose one of {sorted(presets)}")
    return replace(presets[name], **overrides)  # type: ignore[type-var]
