"""Masks as custom-op arguments: a static description (a string) and the list of its tensors.

Shapes: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length.

A ``torch.library`` custom op takes tensors, numbers and strings, not Python objects, so a
traced backend (:mod:`dikkat.core.tiled.traced`) passes a mask as :func:`flatten` gives it: a
JSON description of its structure, each tensor field replaced by its index in a list, and that
list, which the graph then carries as tensor inputs. :func:`rebuild` makes the mask again from
the two, inside the op.

- A mask that is a dataclass of an importable class (every built-in mask, and a caller's own
  dataclass mask defined at module level) is described by its class's import path and its
  fields: sub-masks recursively, bools and None as they are, and tensors, ints and floats by
  their index in a list of each, which the op takes as arguments — dynamo may make an int
  symbolic, so a new window width is no recompile. A dense mask's tensor is passed as its 4-D
  view (:meth:`DenseMask._as4d`), so that in every built-in mask a tensor's dim 0 is the batch
  (size 1: shared by the batch).
- Any other mask (not a dataclass, a class defined inside a function, a field of another kind)
  is registered by identity, with its tensors baked in: the description holds only its key in
  a registry that keeps the object for the life of the process (build such a mask once, not
  once per call), and the op cannot see its tensors change.

Rebuilding sets the fields directly, without running ``__post_init__``: the mask it copies was
validated when it was made.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from dikkat.core.mask_base import DenseMask, Mask
from dikkat.core.mask_keys import BUILTIN_MASKS

__all__ = ["Flat", "builtin_only", "flatten", "rebuild", "tensor_names"]

# masks that flatten could not describe by their fields, by the key their description holds
_REGISTERED: dict[str, Mask] = {}


class Flat(NamedTuple):
    """A mask as op arguments: its structure, its tensors, its int and float fields."""

    description: str
    tensors: list[Tensor]
    ints: list[int]
    floats: list[float]


def flatten(mask: Mask | None) -> Flat:
    """A mask (None: ``"null"``, nothing else) as op arguments; the description is
    deterministic — the same for two masks of the same types and structure."""
    flat = Flat("", [], [], [])
    return flat._replace(description=_describe(mask, flat))


def _describe(mask: Mask | None, flat: Flat) -> str:
    if mask is None:
        return "null"
    cls = type(mask)
    described = len(flat.tensors), len(flat.ints), len(flat.floats)
    parts = []
    if dataclasses.is_dataclass(mask) and "<locals>" not in cls.__qualname__:
        for f in dataclasses.fields(mask):
            part = _field(mask, f.name, flat)
            if part is None:  # a field of a kind a string cannot carry
                break
            parts.append(f'"{f.name}": {part}')
        else:
            fields = ", ".join(parts)
            return f'{{"class": "{cls.__module__}:{cls.__qualname__}", "fields": {{{fields}}}}}'
    for values, n in zip((flat.tensors, flat.ints, flat.floats), described, strict=True):
        del values[n:]  # the fields of a mask registered whole stay inside it
    key = f"{cls.__module__}:{cls.__qualname__}@{id(mask)}"  # dynamo guards on the id
    return _register(key, mask)


def _assume_constant_result(fn: Callable[..., str]) -> Callable[..., str]:
    """``torch.compiler.assume_constant_result`` without importing torch._dynamo, which the
    decorator does and which adds about a second to every ``import dikkat``: all it does is set
    this attribute (torch/_dynamo/decorators.py), and tests/core/test_tiled_traced.py checks
    that torch's decorator still sets only that."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_assume_constant_result  # run while dynamo traces, not replayed after the graph
def _register(key: str, mask: Mask) -> str:
    """The description of a mask kept whole in the registry under ``key``: the op that
    rebuilds it may run inside the very graph being traced, before dynamo would replay a side
    effect."""
    _REGISTERED[key] = mask
    return f'{{"registered": "{key}"}}'


def _field(mask: Mask, name: str, flat: Flat) -> str | None:
    """A field's description; ints and floats go to the op as numbers (dynamo may make them
    symbolic: a sliding window's width changes without a recompile)."""
    value = getattr(mask, name)
    if isinstance(value, Tensor):
        flat.tensors.append(mask._as4d() if isinstance(mask, DenseMask) else value)
        return f'{{"tensor": {len(flat.tensors) - 1}}}'
    if isinstance(value, Mask):
        return _describe(value, flat)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        flat.ints.append(value)
        return f'{{"int": {len(flat.ints) - 1}}}'
    if isinstance(value, float):
        flat.floats.append(value)
        return f'{{"float": {len(flat.floats) - 1}}}'
    return None


def rebuild(
    description: str, tensors: list[Tensor], ints: list[int], floats: list[float]
) -> Mask | None:
    """The mask :func:`flatten` described, from its fields as the op receives them (the
    tensors may be the op's own copies, or a batch folded into dim 0)."""
    return _build(_parse(description), Flat(description, tensors, ints, floats))


@functools.lru_cache(maxsize=256)
def _parse(description: str) -> object:
    return json.loads(description)


def _build(node: object, flat: Flat) -> Mask | None:
    if node is None:
        return None
    if "registered" in node:  # type: ignore[operator]
        key = node["registered"]  # type: ignore[index]
        if key not in _REGISTERED:
            raise ValueError(
                f"mask {key} was registered by identity in another process: a traced program "
                "that holds such a mask runs only where it was traced"
            )
        return _REGISTERED[key]
    cls = _import(node["class"])  # type: ignore[index]
    mask = object.__new__(cls)
    for name, value in node["fields"].items():  # type: ignore[index]
        if isinstance(value, dict):
            value = _value(value, flat)
        object.__setattr__(mask, name, value)  # frozen dataclasses, validated when first made
    return mask


def _value(node: dict, flat: Flat) -> object:
    if "tensor" in node:
        return flat.tensors[node["tensor"]]
    if "int" in node:
        return int(flat.ints[node["int"]])
    if "float" in node:
        return float(flat.floats[node["float"]])
    return _build(node, flat)


@functools.lru_cache(maxsize=64)
def _import(path: str) -> type:
    module, _, qualname = path.partition(":")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Mask)):
        raise ValueError(f"{path} in a mask description is not a dikkat Mask class")
    return obj


def tensor_names(description: str) -> list[str]:
    """How an error names each tensor of a description: ``Padding.lengths``, ``Document.ids``."""
    names: dict[int, str] = {}

    def walk(node: object) -> None:
        if not isinstance(node, dict) or "fields" not in node:
            return
        cls = node["class"].rpartition(":")[2]
        for name, value in node["fields"].items():
            if isinstance(value, dict) and "tensor" in value:
                names[value["tensor"]] = f"{cls}.{name}"
            walk(value)

    walk(_parse(description))
    return [names[i] for i in range(len(names))]


def builtin_only(description: str) -> bool:
    """Whether a description holds dikkat's own mask types only: then the predicate reads the
    batch index only through its tensors, and each tensor's dim 0 is the batch (size 1: shared
    by the batch). A caller's own mask may read the batch index any way."""

    def walk(node: object) -> bool:
        if node is None:
            return True
        if "registered" in node:  # type: ignore[operator]
            return False
        if _import(node["class"]) not in BUILTIN_MASKS:  # type: ignore[index]
            return False
        return all(
            walk(value)
            for value in node["fields"].values()  # type: ignore[index]
            if isinstance(value, dict) and ("class" in value or "registered" in value)
        )

    return walk(_parse(description))
