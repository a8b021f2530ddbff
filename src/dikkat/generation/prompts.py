"""Prompts as the generation functions take them: checked, and left-padded to one length.

Notation: ``B`` batch, ``T`` prompt length (after left padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dikkat.layers.inputs import check_token_id, check_token_ids
from dikkat.validate import check_int, is_int

Prompts = Sequence[Sequence[int]] | Tensor


def check_prompts(prompts: object, vocab_size: int | None = None) -> None:
    """``prompts`` is an integer tensor (B, T) or a non-empty list of non-empty prompts, each a
    list (or 1-D integer tensor) of token ids, inside the vocabulary when ``vocab_size`` is given.
    """
    if isinstance(prompts, Tensor):
        check_token_ids("prompts", prompts, vocab_size)
        if prompts.numel() == 0:
            raise ValueError(f"every prompt needs at least one token, got {tuple(prompts.shape)}")
        return
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        hint = " (convert a numpy array with torch.as_tensor)" if hasattr(prompts, "shape") else ""
        raise TypeError(
            f"prompts must be a (B, T) integer tensor or a list of prompts, each a list of int "
            f"token ids, got {type(prompts).__name__}{hint}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts holds no prompt; pass at least one, e.g. [[1, 2]]")
    for b, prompt in enumerate(prompts):
        _check_prompt(b, prompt, vocab_size)


def _check_prompt(b: int, prompt: object, vocab_size: int | None) -> None:
    name = f"prompts[{b}]"
    if isinstance(prompt, Tensor):
        check_token_ids(name, prompt, None, layout=("T",))
        prompt = prompt.tolist()
    if is_int(prompt):
        raise TypeError(
            f"{name} is the token id {prompt!r}, not a prompt: prompts is a list of prompts, so "
            f"one prompt is written [[1, 2]], not [1, 2]"
        )
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"{name} must be a list of int token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError(f"{name} is empty: every prompt needs at least one token")
    for t, token in enumerate(prompt):
        if not is_int(token):  # a float would be truncated to an id silently
            raise TypeError(f"{name}[{t}] is {token!r} ({type(token).__name__}), not an int id")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f"outside the vocabulary of {vocab_size}" if vocab_size else "a negative id"
            raise ValueError(f"prompts holds {token} at ({b}, {t}), {where}")


def left_pad(
    prompts: Prompts, pad_id: int = 0, *, vocab_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """Prompts → ids (B, T) left-padded with ``pad_id`` and ``valid`` (B, T) (False = padding).

    The prompts are checked by :func:`check_prompts` (against ``vocab_size`` when given).
    """
    check_prompts(prompts, vocab_size)
    if vocab_size is None:
        check_int("pad_id", pad_id, at_least=0)
    else:
        check_token_id("pad_id", pad_id, vocab_size)
    if isinstance(prompts, Tensor):
        return prompts, torch.ones_like(prompts, dtype=torch.bool)
    rows = [p.tolist() if isinstance(p, Tensor) else list(p) for p in prompts]
    T = max(len(p) for p in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, p in enumerate(rows):
        ids[b, T - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        valid[b, T - len(p) :] = True
    return ids, valid
