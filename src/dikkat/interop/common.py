"""What every Hugging Face port shares: accepting a model object or a state dict + config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


def state_and_config(source: Any, config: Any, what: str) -> tuple[Mapping[str, Tensor], Any]:
    """(state dict, config) from an HF model object, or from a state dict and its config."""
    if isinstance(source, Mapping):
        if config is None:
            raise ValueError(f"a {what} state dict needs its config as well")
        return source, config
    if not hasattr(source, "state_dict"):
        raise TypeError(f"expected an HF {what} model or a state dict, got {type(source).__name__}")
    return source.state_dict(), source.config if config is None else config
