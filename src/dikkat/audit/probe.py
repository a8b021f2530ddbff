"""What every audit needs of the model it probes: its output as one tensor, its token embedding,
evaluation mode, a float64 copy of it, and the tolerance that tells a change from rounding.

Notation: ``B`` batch, ``T`` positions, ``F`` output features per position (flattened), ``C``
embedding width.

A model under audit is any callable from token ids (B, T) to per-position outputs (B, T, …):
a dikkat model, a Hugging Face model (its ``.logits`` or ``.last_hidden_state``), or a plain
function. :func:`outputs` turns whatever it returns into one (B, T, F) tensor.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

Model = Callable[[Tensor], object]  # ids or inputs (B, T, …) → outputs (B, T, …)

# A change of an output counts above this fraction of that output's dependence on the tokens its
# mask shows it, by the dtype the probes run in (docs/audit.md, "What ok means"). A correct mask
# leaves a hidden output bit-identical, so only nondeterministic kernels need any slack; the
# float64 value sits seven orders above its rounding (~1e-16) and four below a 1e-5 leak.
RTOL = {torch.float64: 1e-9, torch.float32: 1e-6, torch.float16: 1e-2, torch.bfloat16: 1e-2}


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
    """The module a callable is, or whose bound method it is (``model.forward``); for a
    ``functools.partial``, that of its function, else its first argument that is a module;
    else None."""
    if isinstance(fn, functools.partial):
        found = module_of(fn.func)
        given = (*fn.args, *fn.keywords.values())
        return found or next((a for a in given if isinstance(a, nn.Module)), None)
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


def in_dtype(
    fn: Model, embedding: nn.Module | None, dtype: torch.dtype | None, ids: Tensor
) -> tuple[Model, nn.Module | None, str]:
    """``fn`` and ``embedding`` as the probes run them, and how, in words: a copy of the model
    in ``dtype`` when :func:`module_of` finds it (the given one is not touched); else, or when
    the copy fails on ``ids``, as given.

    The copy is taken together with ``embedding``, so a given embedding that belongs to the
    model is the copy's. Only floating-point parameters and buffers change dtype.
    """
    if dtype is None:
        return fn, embedding, "as given, dtype=None"
    module = module_of(fn)
    name = dtype_name(dtype)
    if module is None:
        how = f"a module, its method, or a functools.partial holding one runs as a {name} copy"
        return fn, embedding, f"as given: a plain function ({how})"
    floats = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    if all(t.dtype == dtype for t in floats):
        return fn, embedding, "as given"
    run, run_embedding = copy.deepcopy((fn, embedding))
    module_of(run).to(dtype)
    try:
        output_tensor(run(ids))
    except (RuntimeError, TypeError, NotImplementedError) as error:  # a kernel without float64
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
        return fn, embedding, f"as given: its {name} copy failed ({reason})"
    return run, run_embedding, "a copy of the model"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
