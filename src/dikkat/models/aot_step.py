"""Decode steps compiled ahead of time and kept on disk, so that only a machine's first run of
a model pays for compiling them.

:class:`~dikkat.models.static_step.StaticStep` with ``compile=True`` goes through
``torch.compile``: every new process traces the model again with TorchDynamo (seconds for 30
layers, even when inductor finds its kernels in its on-disk cache), after importing dynamo and
inductor (more seconds). Here the same steps — :class:`AotStep`, one row over a static cache
(:func:`~dikkat.models.static_step._step`), and :class:`AotPoolStep`, a batch of rows over
pools of slots (``_pool_step``, the serving engine's) — are exported once with the cache's
length (and the batch) symbolic, and compiled into a package that later processes load in
milliseconds (:mod:`dikkat.models.aot_package`: what is kept where, and how it is keyed and
bound to the model's tensors). Where a package cannot be built, :func:`compiled_step` and
:func:`compiled_pool_step` fall back with one line saying why.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.generation.protocol import LayeredLM
from dikkat.layers.kv_cache import KVCache
from dikkat.models.aot_package import Package, StepCompileError, compiled_dir, tensors_of
from dikkat.models.static_step import PoolStep, StaticStep, _pool_step, _step

__all__ = [
    "AotPoolStep",
    "AotStep",
    "StepCompileError",
    "aot_applies",
    "compile_by_default",
    "compiled_dir",
    "compiled_pool_step",
    "compiled_step",
]

MAX_ROWS = 1024  # the most rows a compiled batch step takes


def compile_by_default() -> bool:
    """Whether a pretrained model decodes through its compiled step unless told otherwise:
    yes, unless the environment sets ``DIKKAT_COMPILE=0`` (or false, no, off)."""
    return os.environ.get("DIKKAT_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def aot_applies(model: nn.Module, keys: Tensor) -> bool:
    """Whether a step compiled ahead of time serves ``model`` over ``keys`` (a layer's cache or
    pool): fp32 keys on the CPU, and every tensor of the model on the CPU (the native kernels'
    case)."""
    return (
        keys.dtype == torch.float32
        and keys.is_cpu
        and all(t.is_cpu for t in tensors_of(model).values())
    )


def _slots_dim(model: nn.Module) -> Any:
    return torch.export.Dim("slots", min=2, max=max(2, model.config.max_len))  # type: ignore[union-attr,operator]


class AotStep(StaticStep):
    """:class:`~dikkat.models.static_step.StaticStep`'s decode steps (same call, same checks)
    of one row through a package AOTInductor compiled (module docstring): built the first time a
    model is decoded on a machine, with a line on stderr saying so, then loaded from ``folder``
    (default :func:`compiled_dir`). A :class:`StepCompileError` where it cannot be built or
    loaded.

    The package is bound to ``model``'s tensors when the step is made: values changed in place
    reach it; tensors replaced after (``.to()``, a new parameter) reach the next step made, not
    this one, which keeps the old ones alive."""

    def __init__(self, model: LayeredLM, cache: Sequence[KVCache], *,
                 folder: str | Path | None = None) -> None:  # fmt: skip
        super().__init__(model, cache)
        k = self._keys[0]
        if k.shape[0] != 1 or not aot_applies(model, k):  # type: ignore[arg-type]
            raise StepCompileError(
                "a compiled step ahead of time takes one row of fp32 keys on the CPU, got "
                f"{tuple(k.shape)} {k.dtype} on {k.device}"
            )

        def inputs() -> tuple[Any, Any]:
            slots, n = _slots_dim(model), len(self._keys)  # type: ignore[arg-type]
            tokens, pos = torch.zeros(1, dtype=torch.long), torch.tensor(0)
            dynamic = ([{2: slots}] * n, [{2: slots}] * n, None, None)
            return (self._keys, self._values, tokens, pos), dynamic

        folder = compiled_dir() if folder is None else Path(folder)
        self._package = Package(model, self._windows, "step", _step, inputs, "one row", folder)  # type: ignore[arg-type]
        self.key, self.package = self._package.key, self._package.package
        self.built, self._runner = self._package.built, self._package.runner
        self._fn = self._run

    def _run(self, model: object, windows: object, keys: list[Tensor], values: list[Tensor],
             tokens: Tensor, pos: Tensor) -> Tensor:  # fmt: skip
        return self._runner.boxed_run([*keys, *values, tokens, pos])[0]


class AotPoolStep(PoolStep):
    """:class:`~dikkat.models.static_step.PoolStep`'s decode steps (same call, same checks) of
    a batch of rows over pools of slots through a package AOTInductor compiled, the batch and
    the slots a row may read symbolic, as :class:`AotStep` (which says what is kept where)."""

    def __init__(self, model: LayeredLM, keys: Sequence[Tensor], values: Sequence[Tensor], *,
                 folder: str | Path | None = None) -> None:  # fmt: skip
        super().__init__(model, keys, values)
        if not aot_applies(model, self._keys[0]):  # type: ignore[arg-type]
            k = self._keys[0]
            raise StepCompileError(
                f"a compiled step ahead of time takes fp32 pools on the CPU, got {k.dtype} on "
                f"{k.device}"
            )

        def inputs() -> tuple[Any, Any]:
            rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
            slots = _slots_dim(model)  # type: ignore[arg-type]
            # traced with two rows of four slots (a size of 1 would be taken for a constant),
            # each input a tensor of its own (one tensor given twice is traced as one input)
            tokens, positions = torch.zeros(2, dtype=torch.long), torch.tensor([1, 2])
            example = (self._keys, self._values, tokens, positions, torch.arange(8).view(2, 4))
            static = [None] * len(self._keys)  # the pools' sizes are fixed
            return example, (static, static, {0: rows}, {0: rows}, {0: rows, 1: slots})

        folder = compiled_dir() if folder is None else Path(folder)
        fixed = f"pools {tuple(self._keys[0].shape)}"
        self._package = Package(model, self._windows, "pool", _pool_step, inputs, fixed, folder)  # type: ignore[arg-type]
        self.key, self.package = self._package.key, self._package.package
        self.built, self._runner = self._package.built, self._package.runner
        self._fn = self._run

    def _run(self, model: object, windows: object, keys: list[Tensor], values: list[Tensor],
             tokens: Tensor, positions: Tensor, slots: Tensor) -> Tensor:  # fmt: skip
        return self._runner.boxed_run([*keys, *values, tokens, positions, slots])[0]


def compiled_step(model: LayeredLM, cache: Sequence[KVCache],
                  say: Callable[[str], None] | None = None) -> StaticStep:  # fmt: skip
    """The fastest decode step of ``model`` over ``cache`` that builds here: :class:`AotStep`
    for one row on the CPU, else ``torch.compile``'d; where the compile fails, the eager step,
    and one line (``say``, default stderr) saying why."""
    k = cache[0].k
    if k.shape[0] != 1 or not aot_applies(model, k):  # type: ignore[arg-type]
        return StaticStep(model, cache, compile=True)
    try:
        return AotStep(model, cache)
    except StepCompileError as e:
        (say or _to_stderr)(f"dikkat: decoding eagerly: the compiled step is unavailable ({e})")
        return StaticStep(model, cache)


def compiled_pool_step(model: LayeredLM, keys: Sequence[Tensor], values: Sequence[Tensor],
                       say: Callable[[str], None] | None = None) -> PoolStep:  # fmt: skip
    """The fastest pool step of ``model`` that builds here: :class:`AotPoolStep` on the CPU,
    else ``torch.compile``'d (and there too where it cannot be built, with one line, ``say``,
    saying why)."""
    if not aot_applies(model, keys[0]):  # type: ignore[arg-type]
        return PoolStep(model, keys, values, compile=True)
    try:
        return AotPoolStep(model, keys, values)
    except StepCompileError as e:
        (say or _to_stderr)(f"dikkat: the batch decode step compiles in each process instead: "
                            f"the step compiled ahead of time is unavailable ({e})")  # fmt: skip
        return PoolStep(model, keys, values, compile=True)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
