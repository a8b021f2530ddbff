"""The model families dikkat reads, one module each (``llama.py``, ``mistral.py``, ``qwen2.py``,
``gemma3.py``, ``gpt2.py``), and the registry derived from them.

A module of this package that defines ``FAMILY`` (a :class:`~dikkat.pretrained.families.base.
Family`) is a family: it is found by listing the package's folder (``pkgutil.iter_modules``
over ``__path__``), so a new file is the whole of adding one (docs/models.md, "Adding a
family"). Modules without ``FAMILY`` (``base``, ``common``) hold what families share.
"""

from __future__ import annotations

import importlib
import pkgutil

from dikkat.pretrained.families.base import Family, PreSplit
from dikkat.pretrained.gguf_file import shown

__all__ = ["Family", "by_gguf_architecture", "by_hf_model_type", "families", "pre_splits"]


def families() -> dict[str, Family]:
    """Every family, by name (the modules are imported once; listing the folder again on each
    call is what lets a file added to ``__path__`` count)."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if not isinstance(family, Family):
            continue
        if family.name in found:
            raise ValueError(f"two family modules declare the family {family.name!r}")
        found[family.name] = family
    _check_unique(found)
    return found


def _check_unique(found: dict[str, Family]) -> None:
    """No GGUF architecture, HF model_type or tokenizer name is declared by two families."""
    owner: dict[tuple[str, str], str] = {}
    for family in found.values():
        keys = [("GGUF architecture", family.gguf_architecture)] * bool(family.gguf_architecture)
        keys += [("HF model_type", t) for t in (*family.hf_model_types, *family.hf_refused)]
        keys += [("tokenizer.ggml.pre", name) for name in family.pre_splits]
        for key in keys:
            if key in owner:
                raise ValueError(
                    f"the families {owner[key]!r} and {family.name!r} both declare the "
                    f"{key[0]} {key[1]!r}"
                )
            owner[key] = family.name  # type: ignore[index]


def by_gguf_architecture(arch: object, source: str) -> Family:
    """The family whose GGUF files name ``general.architecture`` = ``arch``."""
    readable = {f.gguf_architecture: f for f in families().values() if f.config_from_gguf}
    family = readable.get(arch)  # type: ignore[call-overload]
    if family is None:
        raise ValueError(
            f"{source}: GGUF architecture {shown(arch)} is not one dikkat runs; it reads "
            f"{', '.join(sorted(map(str, readable)))}"
        )
    return family


def by_hf_model_type(model_type: object, source: str) -> Family:
    """The family of an HF ``config.json`` whose ``model_type`` is ``model_type``."""
    readable, refused = {}, {}
    for f in families().values():
        if f.config_from_hf is not None:
            readable |= dict.fromkeys(f.hf_model_types, f)
        refused |= f.hf_refused
    family = readable.get(model_type)  # type: ignore[call-overload]
    if family is None:
        why = refused.get(model_type)  # type: ignore[call-overload]
        hint = f" ({why})" if why else ""
        raise ValueError(
            f"{source}: model_type {model_type!r} is not one dikkat runs{hint}; it reads "
            f"{', '.join(sorted(readable))}"
        )
    return family


def pre_splits() -> dict[str, PreSplit]:
    """Every family's tokenizer pre-splits, by ``tokenizer.ggml.pre`` name (a name names a
    tokenizer, whichever architecture's file carries it: Mistral's GGUF files are ``llama``
    ones)."""
    return {name: s for f in families().values() for name, s in f.pre_splits.items()}
