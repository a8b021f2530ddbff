"""A decode step compiled ahead of time and kept on disk, so that only a machine's first run of a
model pays for compiling it.

:class:`~dikkat.models.static_step.StaticStep` with ``compile=True`` goes through
``torch.compile``: every new process traces the model again with TorchDynamo (seconds for 30
layers, even when inductor finds its kernels in its on-disk cache), after importing dynamo and
inductor (more seconds). Here the same step — :func:`~dikkat.models.static_step._step`, one
row of fp32 activations on the CPU — is exported once (``torch.export``) with the cache's
length symbolic, and compiled by AOTInductor into a package (a shared library and its
metadata; https://pytorch.org/docs/stable/torch.compiler_aot_inductor.html). A later process
loads that package with ``torch._C._aoti.AOTIModelPackageLoader``, which imports neither
dynamo nor inductor, in milliseconds.

The package holds no weights (``aot_inductor.package_constants_in_so=False``): its constants
— the model's packed blocks, norms, RoPE tables — are bound at load to the model's own tensors
(``load_constants(..., user_managed=True)``: pointers, no copy), so memory holds the weights
once. AOTInductor names a constant as the traced graph did (``_tensor_constant12``), which says
nothing of where the tensor lives in the model; so the build records, from the graph inductor
lowers (a post-grad pass that reads each constant the graph fetches), which of the model's
tensors each name is, by the path that reaches it (``blocks.3.attn.qkv_proj.parts.0.values``),
and keeps that beside the package.

Packages live under ``compiled`` in dikkat's cache (:func:`compiled_dir`), named by a key of
what makes one valid for a model: its module tree, its tensors' paths, shapes, dtypes and
strides (and the values of the smallest, which inductor may write into its code), the sliding
windows, dikkat's own source, the PyTorch version and the CPU. A package is written under a
temporary name and renamed into place with its record (size and SHA-256) after it, and checked
against that record before it is loaded: a damaged one is rebuilt.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.files import atomic_write, cache_dir, record, verify, write_text
from dikkat.generation.protocol import LayeredLM
from dikkat.kernels import cpu_identity, paged_attention_op
from dikkat.layers.kv_cache import KVCache
from dikkat.models.static_step import StaticStep, _step

__all__ = ["AotStep", "StepCompileError", "aot_applies", "compile_by_default", "compiled_dir"]

VERSION = 1  # the package's layout and its record's; a change needs a new one
_INLINED = 16  # tensors of at most this many numbers may be written into the code: keyed by value


class StepCompileError(RuntimeError):
    """The step could not be compiled or loaded here (no compiler, an unsupported model); the
    message says why. The eager step computes the same."""


def compile_by_default() -> bool:
    """Whether a pretrained model decodes through its compiled step unless told otherwise:
    yes, unless the environment sets ``DIKKAT_COMPILE=0``."""
    return os.environ.get("DIKKAT_COMPILE", "1").strip() != "0"


def compiled_dir() -> Path:
    """Where compiled steps are kept: ``compiled`` in dikkat's cache
    (:func:`dikkat.files.cache_dir`)."""
    return cache_dir() / "compiled"


def aot_applies(model: nn.Module, cache: Sequence[KVCache]) -> bool:
    """Whether :class:`AotStep` serves ``model`` over ``cache``: one row of fp32 keys on the CPU,
    and every tensor of the model on the CPU (the native kernels' case)."""
    k = cache[0].k if cache else None
    return (
        k is not None
        and k.shape[0] == 1
        and k.dtype == torch.float32
        and k.is_cpu
        and all(t.is_cpu for t in _tensors(model).values())
    )


def _tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every tensor ``model`` holds, by the first path that reaches it: through submodules,
    their parameters, buffers and public attributes (the private ones hold what a forward
    caches, as RoPE's last table), and the lists, dicts and dataclasses of dikkat's weight
    holders (a packed layer's ``parts``). The order is the module tree's, so the same model
    built again gives the same paths."""
    found: dict[str, Tensor] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            found[path] = obj
            return
        if isinstance(obj, nn.Module):
            for k, v in vars(obj).items():  # its private attributes are caches made on use
                if k in ("_parameters", "_buffers", "_modules"):
                    for name, value in v.items():
                        walk(value, f"{path}{name}.")
                elif not k.startswith("_"):
                    walk(v, f"{path}{k}.")
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}{k}.")
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(v, f"{path}{i}.")
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), f"{path}{f.name}.")
        elif type(obj).__module__.startswith("dikkat.") and hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                walk(v, f"{path}{k}.")

    walk(model, "")
    return {path.rstrip("."): t for path, t in found.items()}


def _identity(t: Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


@functools.cache
def _source_digest() -> bytes:
    """dikkat's own source (Python and C++): the traced graph and the kernels it calls."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h"))
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.digest()


def step_key(model: nn.Module, windows: tuple[int | None, ...]) -> str:
    """The name of ``model``'s compiled step: what a package depends on (module docstring)."""
    digest = hashlib.sha256()
    for part in (VERSION, torch.__version__, cpu_identity(), repr(model), repr(windows)):
        digest.update(str(part).encode() + b"\0")
    digest.update(_source_digest())
    for path, t in _tensors(model).items():
        digest.update(f"{path} {tuple(t.shape)} {t.stride()} {t.dtype}\0".encode())
        if t.numel() <= _INLINED:
            digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


class _StepModule(nn.Module):
    """The step as a module, for torch.export: the caches and the token are its inputs."""

    def __init__(self, model: nn.Module, windows: tuple[int | None, ...]) -> None:
        super().__init__()
        self.model, self.windows = model, windows

    def forward(self, keys: list[Tensor], values: list[Tensor], tokens: Tensor,
                pos: Tensor) -> Tensor:  # fmt: skip
        return _step(self.model, self.windows, keys, values, tokens, pos)  # type: ignore[arg-type]


def _build(model: nn.Module, windows: tuple[int | None, ...], keys: list[Tensor],
           values: list[Tensor], package: Path) -> dict[str, str]:  # fmt: skip
    """Export and compile the step into ``package``; returns each constant's path in the model."""
    fetched: dict[str, Tensor] = {}

    def note_constants(graph: torch.fx.Graph) -> None:
        root = graph.owning_module
        for node in graph.find_nodes(op="get_attr"):
            value: Any = root
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if isinstance(value, Tensor):
                fetched[str(node.target)] = value

    slots = torch.export.Dim("slots", min=2, max=max(2, model.config.max_len))  # type: ignore[union-attr]
    dynamic = ([{2: slots}] * len(keys), [{2: slots}] * len(values), None, None)
    example = (keys, values, torch.zeros(1, dtype=torch.long), torch.tensor(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export's and inductor's notes on their own internals
        program = torch.export.export(
            _StepModule(model, windows), example, dynamic_shapes=dynamic, strict=False
        )
        torch._inductor.aoti_compile_and_package(
            program,
            package_path=str(package),
            inductor_configs={
                "aot_inductor.package_constants_in_so": False,
                "post_grad_custom_post_pass": note_constants,
            },
        )
    paths = {_identity(t): path for path, t in _tensors(model).items()}
    where: dict[str, str] = {}
    # the constants the package asks for: of those the graph fetched, the ones inductor did not
    # write into its code (a tensor of a few numbers) nor find the same as another (a tied one)
    for name in _runner(package).get_constant_fqns():
        t = fetched.get(name)
        path = None if t is None else paths.get(_identity(t))
        if t is None or path is None:
            raise StepCompileError(
                f"the compiled step reads a tensor {name} that is none of the model's"
            )
        where[name] = path.removeprefix("model.")
    return where


# the packages loaded for a model, bound to its tensors: its next decode (a chat's next turn, a
# cache of another length) reuses them
_LOADED: weakref.WeakKeyDictionary[nn.Module, dict[Path, Any]] = weakref.WeakKeyDictionary()


def _runner(package: Path) -> Any:
    """The package's loader, which runs it (one runner, not single-threaded, on the CPU)."""
    return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)


class AotStep(StaticStep):
    """:class:`~dikkat.models.static_step.StaticStep`'s decode steps (same call, same checks)
    through a package AOTInductor compiled (module docstring): built the first time a model is
    decoded on a machine, with a line on stderr saying so, then loaded from ``folder`` (default
    :func:`compiled_dir`). A :class:`StepCompileError` where it cannot be built or loaded.

    The package is bound to ``model``'s tensors, which must stay as they are (the values may
    change in place, not the tensors)."""

    def __init__(self, model: LayeredLM, cache: Sequence[KVCache], *,
                 folder: str | Path | None = None) -> None:  # fmt: skip
        super().__init__(model, cache)
        if not aot_applies(model, cache):  # type: ignore[arg-type]
            raise StepCompileError(
                "a compiled step ahead of time takes one row of fp32 keys on the CPU, got "
                f"{tuple(self._keys[0].shape)} {self._keys[0].dtype} on {self._keys[0].device}"
            )
        folder = compiled_dir() if folder is None else Path(folder)
        self.key = step_key(model, self._windows)  # type: ignore[arg-type]
        self.package = folder / f"step-{self.key}.pt2"
        self.built = False  # whether this object compiled its package (else it loaded one)
        loaded = _LOADED.setdefault(model, {})  # type: ignore[arg-type]
        runner = loaded.get(self.package) or self._load()
        if runner is None:
            self._compile(folder)
            runner = self._load()
            if runner is None:
                raise StepCompileError(f"the package just built at {self.package} fails to load")
        self._runner = loaded[self.package] = runner
        self._fn = self._run

    def _run(self, model: object, windows: object, keys: list[Tensor], values: list[Tensor],
             tokens: Tensor, pos: Tensor) -> Tensor:  # fmt: skip
        return self._runner.boxed_run([*keys, *values, tokens, pos])[0]

    def _record(self) -> Path:
        return self.package.with_suffix(".json")

    def _load(self) -> Any:
        """The package's runner, its constants bound to the model's tensors; None where there is
        no package, or its record does not match it (damaged: it is rebuilt)."""
        try:
            entry = json.loads(self._record().read_text())
            if entry.get("version") != VERSION:
                return None
            verify(self.package, entry["package"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            if self.package.exists() or self._record().exists():
                print(f"dikkat: the compiled step {self.package.name} is unusable ({e}); "
                      "compiling it again", file=sys.stderr)  # fmt: skip
            return None
        tensors = _tensors(self.model)  # type: ignore[arg-type]
        missing = [path for path in entry["constants"].values() if path not in tensors]
        if missing:
            raise StepCompileError(f"the model has no tensors {missing[:3]} the step reads")
        paged_attention_op()  # the kernels' ops are registered before the package calls them
        runner = _runner(self.package)
        constants = {name: tensors[path] for name, path in entry["constants"].items()}
        if set(runner.get_constant_fqns()) != set(constants):
            return None
        # (constants, use the inactive buffer, check every one is given, user-managed, h2d copy)
        runner.load_constants(constants, False, True, True, False)
        return runner

    def _compile(self, folder: Path) -> None:
        print("dikkat: compiling the decode step of this model for this machine (once; a "
              "minute or so) …", file=sys.stderr, flush=True)  # fmt: skip
        start = time.perf_counter()
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
            built = Path(tmp) / self.package.name
            try:
                where = _build(self.model, self._windows, self._keys, self._values, built)
            except StepCompileError:
                raise
            except Exception as e:  # export's and inductor's errors have no common base
                raise StepCompileError(f"{type(e).__name__}: {str(e).splitlines()[0]}") from e
            entry = {"version": VERSION, "package": record(built), "constants": where}
            atomic_write(self.package, lambda to: shutil.copyfile(built, to))
            write_text(self._record(), json.dumps(entry, indent=1))
        self.built = True
        print(f"dikkat: compiled in {time.perf_counter() - start:.0f} s, kept in "
              f"{self.package}", file=sys.stderr)  # fmt: skip


def compiled_step(model: LayeredLM, cache: Sequence[KVCache],
                  say: Callable[[str], None] | None = None) -> StaticStep:  # fmt: skip
    """The fastest decode step of ``model`` over ``cache`` that builds here: :class:`AotStep`
    where it applies, else ``torch.compile``'d; where the compile fails, the eager step, and
    one line (``say``, default stderr) saying why."""
    if not aot_applies(model, cache):  # type: ignore[arg-type]
        return StaticStep(model, cache, compile=True)
    try:
        return AotStep(model, cache)
    except StepCompileError as e:
        (say or _to_stderr)(f"dikkat: decoding eagerly: the compiled step is unavailable ({e})")
        return StaticStep(model, cache)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
