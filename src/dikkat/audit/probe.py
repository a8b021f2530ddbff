"""What every audit needs of the model it probes: its output as one tensor, its token embedding,
evaluation mode, and the tolerance that tells a change from rounding.

Notation: ``B`` batch, ``T`` positions, ``F`` output features per position (flattened), ``C``
embedding width.

A model under audit is any callable from token ids (B, T) to per-position outputs (B, T, …):
a dikkat model, a Hugging Face model (its ``.logits`` or ``.last_hidden_state``), or a plain
function. :func:`outputs` turns whatever it returns into one (B, T, F) tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from dikkat.validate import check_float

Model = Callable[[Tensor], object]  # ids or inputs (B, T, …) → outputs (B, T, …)

RTOL = 1e-4  # a change counts above this fraction of the output scale (see mask_audit's docs)


def output_tensor(result: object) -> Tensor:
    """The tensor a call returned: itself, ``.logits``, ``.last_hidden_state``, or the first item
    of a tuple or list."""
    if isinstance(result, Tensor):
        return result
    for name in ("logits", "last_hidden_state"):
        value = getattr(result, name, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor):
        return result[0]
    raise TypeError(
        "the model must return a tensor (B, T, …), a tuple whose first item is one, or an "
        f"object with .logits or .last_hidden_state; got {type(result).__name__}"
    )


def outputs(fn: Model, x: Tensor) -> Tensor:
    """``fn(x)`` as a (B, T, F) tensor; refused unless it has one output per input position."""
    out = output_tensor(fn(x))
    if out.dim() < 2 or tuple(out.shape[:2]) != tuple(x.shape[:2]):
        raise ValueError(
            f"the model must give one output per position, (B, T, …) = {tuple(x.shape[:2])} "
            f"first, for inputs of shape {tuple(x.shape)}; got outputs of shape {tuple(out.shape)}"
        )
    if not bool(torch.isfinite(out).all()):
        raise ValueError(
            "the model's outputs hold NaN or inf for random inputs: an audit compares outputs, "
            "which needs them finite"
        )
    return out.reshape(out.shape[0], out.shape[1], -1)


def module_of(fn: object) -> nn.Module | None:
    """The module a callable is, or whose bound method it is (``model.forward``); else None."""
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def device_of(fn: object, device: torch.device | str | None) -> torch.device:
    """``device`` if given, else where the model's first parameter lives, else the CPU."""
    if device is not None:
        return torch.device(device)
    module = module_of(fn)
    param = None if module is None else next(module.parameters(), None)
    return torch.device("cpu") if param is None else param.device


@contextmanager
def evaluating(fn: object) -> Iterator[None]:
    """Within the block, the model (if ``fn`` is one) is in eval mode: dropout off."""
    module = module_of(fn)
    was_training = module is not None and module.training
    if module is not None:
        module.eval()
    try:
        yield
    finally:
        if module is not None:
            module.train(was_training)


def find_embedding(fn: object, vocab_size: int) -> tuple[nn.Module | None, str]:
    """The token embedding of the model ``fn`` is (or is a method of), and how it was found —
    or None and why not.

    Hugging Face models name it by ``get_input_embeddings()``, dikkat's GPT and BERT
    ``tok_emb``; another module qualifies when it holds exactly one ``nn.Embedding`` of
    ``vocab_size`` rows.
    """
    module = module_of(fn)
    if module is None:
        return None, "the model is a plain function (pass embedding= to check gradients)"
    getter = getattr(module, "get_input_embeddings", None)
    if callable(getter):
        found = getter()
        if isinstance(found, nn.Module):
            return found, "get_input_embeddings()"
    if isinstance(getattr(module, "tok_emb", None), nn.Module):
        return module.tok_emb, "tok_emb"
    tables = [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.Embedding) and m.num_embeddings == vocab_size
    ]
    if len(tables) == 1:
        return module.get_submodule(tables[0]), tables[0]
    return None, (
        f"{type(module).__name__} has {len(tables)} embeddings of {vocab_size} rows, not one "
        "(pass embedding= to check gradients)"
    )


def tolerance(out: Tensor, rtol: float) -> float:
    """``rtol`` × the largest |output|: the smallest change that counts."""
    check_float("rtol", rtol, low=0.0)
    return rtol * float(out.abs().max())


def check_deterministic(fn: Model, x: Tensor, out: Tensor, rtol: float) -> None:
    """A second call on the same inputs gives the same outputs, else no change can be blamed
    on a perturbation (dropout left on is the usual cause)."""
    again = outputs(fn, x)
    drift = float((again - out).abs().max())
    if drift > tolerance(out, rtol):
        raise ValueError(
            f"the model gives different outputs for the same inputs (they moved by {drift:.3g}, "
            f"above the tolerance of {tolerance(out, rtol):.3g}): an audit needs a deterministic "
            "model — call model.eval() to switch dropout off"
        )
