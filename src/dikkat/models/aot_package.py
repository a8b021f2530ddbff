"""Compiled programs of a model kept on disk: exported once (``torch.export``), compiled by
AOTInductor into a package (a shared library and its metadata;
https://pytorch.org/docs/stable/torch.compiler_aot_inductor.html), and loaded in later processes
with ``torch._C._aoti.AOTIModelPackageLoader``, which imports neither dynamo nor inductor, in
milliseconds. :mod:`dikkat.models.aot_step` builds the decode steps on it.

A package holds no weights (``aot_inductor.package_constants_in_so=False``): its constants —
the model's packed blocks, norms, RoPE tables — are bound at load to the model's own tensors
(``load_constants(..., user_managed=True)``: pointers, no copy), so memory holds the weights
once. AOTInductor names a constant as the traced graph did (``_tensor_constant12``), which says
nothing of where the tensor lives in the model; so the build records, from the graph inductor
lowers (a post-grad pass that reads each constant the graph fetches), which of the model's
tensors each name is, by the path that reaches it (``blocks.3.attn.qkv_proj.parts.0.values``),
and keeps that beside the package.

Packages live under ``compiled`` in dikkat's cache (:func:`compiled_dir`), named by a key of
what makes one valid for a model (:func:`step_key`): its module tree, its tensors' paths,
shapes, dtypes and strides (and the values of the smallest, which inductor may write into its
code), the sliding windows, what of the inputs is fixed, dikkat's own source, the PyTorch
version and the CPU. A package is written under a temporary name and renamed into place with its
record (size and SHA-256) after it, and checked against that record before it is loaded: a
damaged one is rebuilt; two processes wanting one package build it once
(:mod:`dikkat.models.aot_cache`). A build that fails is recorded too, so that the next process
does not spend its minute again (deleting the record tries again). A build removes the packages
it makes useless: those of an older layout, and those of the same model built by another dikkat
or PyTorch (:func:`dikkat.models.aot_cache.prune`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import shutil
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.files import atomic_write, cache_dir, record, verify, write_text
from dikkat.kernels import cpu_identity, paged_attention_op
from dikkat.layers.moe import SparseMoE, experts_op
from dikkat.models.aot_cache import LAYOUT, one_build, prune

__all__ = [
    "Bound",
    "Package",
    "StepCompileError",
    "compiled_dir",
    "step_key",
    "step_lineage",
    "tensors_of",
]

VERSION = LAYOUT  # the package's layout and its record's (one number, in aot_cache)
_INLINED = 16  # tensors of at most this many numbers may be written into the code: keyed by value


class StepCompileError(RuntimeError):
    """The step could not be compiled or loaded here (no compiler, an unsupported model); the
    message says why. The eager step computes the same."""


def compiled_dir() -> Path:
    """Where compiled steps are kept: ``compiled`` in dikkat's cache
    (:func:`dikkat.files.cache_dir`)."""
    return cache_dir() / "compiled"


def tensors_of(model: nn.Module) -> dict[str, Tensor]:
    """Every tensor ``model`` holds, by the first path that reaches it: through submodules,
    their parameters, buffers and other attributes (but those a module's class lists in
    ``made_on_use``: what a forward fills as it runs, as RoPE's last table), and the lists,
    dicts and dataclasses of dikkat's weight holders (a packed layer's ``parts``, an int8
    layer's ``_q``). The order is the module tree's, so the same model built again gives the
    same paths."""
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
            made_on_use = getattr(obj, "made_on_use", ())
            for k, v in vars(obj).items():
                if k in ("_parameters", "_buffers", "_modules"):
                    for name, value in v.items():
                        walk(value, f"{path}{name}.")
                elif k not in made_on_use and not k.endswith("_hooks"):
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


def step_lineage(model: nn.Module, windows: tuple[int | None, ...], inputs: str = "") -> str:
    """What ``model``'s compiled step is for, without what builds it (dikkat's source, PyTorch,
    the package's layout): packages of one lineage under other keys were built for the same
    model on this machine by another dikkat or PyTorch, and a new build removes them
    (:func:`dikkat.models.aot_cache.prune`). ``inputs`` says what of the step's inputs is fixed
    in it (a pool's slots)."""
    digest = hashlib.sha256()
    for part in (cpu_identity(), repr(model), repr(windows), inputs):
        digest.update(str(part).encode() + b"\0")
    for path, t in tensors_of(model).items():
        digest.update(f"{path} {tuple(t.shape)} {t.stride()} {t.dtype}\0".encode())
        if t.numel() <= _INLINED:
            digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def step_key(model: nn.Module, windows: tuple[int | None, ...], inputs: str = "") -> str:
    """The name of ``model``'s compiled step: what a package depends on (module docstring)."""
    return _key(step_lineage(model, windows, inputs))


def _key(lineage: str) -> str:
    digest = hashlib.sha256(f"{VERSION}\0{torch.__version__}\0{lineage}\0".encode())
    digest.update(_source_digest())
    return digest.hexdigest()[:24]


class _StepModule(nn.Module):
    """A step as a module, for torch.export: the caches, the tokens and where they go are its
    inputs (``step``: :func:`~dikkat.models.static_step._step` or ``_pool_step``)."""

    def __init__(self, model: nn.Module, windows: tuple[int | None, ...],
                 step: Callable[..., Tensor]) -> None:  # fmt: skip
        super().__init__()
        self.model, self.windows, self.step = model, windows, step

    def forward(self, keys: list[Tensor], values: list[Tensor], tokens: Tensor, where: Tensor,
                slots: Tensor | None = None) -> Tensor:  # fmt: skip
        rest = (tokens, where) if slots is None else (tokens, where, slots)
        return self.step(self.model, self.windows, keys, values, *rest)


@dataclasses.dataclass(frozen=True)
class Bound:
    """A loaded package's ``runner`` and the model's tensors its constants point to, by name
    (held here too: the runner's pointers stay valid while it lives, whatever the model does)
    and by their path in the model."""

    runner: Any
    tensors: dict[str, Tensor]
    paths: dict[str, str]

    def current(self, model: nn.Module) -> bool:
        """Whether the model still holds these tensors (not replaced, as ``.to()`` replaces)."""
        now = tensors_of(model)
        return all(now.get(self.paths[name]) is t for name, t in self.tensors.items())


# the packages loaded for a model, bound to its tensors: its next decode (a chat's next turn, a
# cache of another length) reuses them
_LOADED: weakref.WeakKeyDictionary[nn.Module, dict[Path, Bound]] = weakref.WeakKeyDictionary()


def _runner(package: Path) -> Any:
    """The package's loader, which runs it (one runner, not single-threaded, on the CPU)."""
    return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)


class Package:
    """``step(model, windows, keys, values, tokens, where[, slots])`` of ``model`` (``kind``:
    "step", "pool") compiled for inputs like the example ``inputs()`` gives (the caches, the
    tokens and where they go) with the sizes its second half names symbolic (torch.export's
    ``dynamic_shapes``; made only for a build: torch.export.Dim imports sympy), ``fixed``
    saying what else of them the package holds fixed: found in ``folder``, else built there;
    ``runner`` runs it, bound to the model's tensors; ``built`` says whether it was built
    here."""

    def __init__(self, model: nn.Module, windows: tuple[int | None, ...], kind: str,
                 step: Callable[..., Tensor], inputs: Callable[[], tuple[Any, Any]],
                 fixed: str, folder: Path) -> None:  # fmt: skip
        self.model, self.windows, self.kind, self.step = model, windows, kind, step
        self.inputs, self.folder = inputs, folder
        self.lineage = step_lineage(model, windows, f"{kind}: {fixed}")
        self.key = _key(self.lineage)
        self.package = folder / f"{kind}-{self.key}.pt2"
        self.built = False  # whether this object compiled its package (else it loaded one)
        loaded = _LOADED.setdefault(model, {})
        bound = loaded.get(self.package)
        if bound is None or not bound.current(model):  # its tensors replaced: bound again
            bound = self.load()
        if bound is None:
            with one_build(self.package):  # another process building it: wait, then load it
                bound = self.load()
                if bound is None:
                    self._compile()
                    bound = self.load()
            if bound is None:
                raise StepCompileError(f"the package just built at {self.package} fails to load")
        self.bound = loaded[self.package] = bound
        self.runner = bound.runner

    @property
    def record_path(self) -> Path:
        return self.package.with_suffix(".json")

    def load(self) -> Bound | None:
        """The package's runner, its constants bound to the model's tensors; None where there is
        no package, or its record does not match it (damaged: it is rebuilt)."""
        try:
            entry = json.loads(self.record_path.read_text())
            if entry.get("version") != VERSION:
                return None
            if "failed" in entry:  # the last build here failed: not tried at every decode
                raise StepCompileError(
                    f"{entry['failed']} (when it was compiled; delete {self.record_path} to "
                    "try again)"
                )
            verify(self.package, entry["package"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            if self.package.exists() or self.record_path.exists():
                print(f"dikkat: the compiled step {self.package.name} is unusable ({e}); "
                      "compiling it again", file=sys.stderr)  # fmt: skip
            return None
        tensors = tensors_of(self.model)
        missing = [path for path in entry["constants"].values() if path not in tensors]
        if missing:
            raise StepCompileError(f"the model has no tensors {missing[:3]} the step reads")
        paged_attention_op()  # the kernels' ops are registered before the package calls them
        if any(isinstance(m, SparseMoE) for m in self.model.modules()):
            experts_op()  # and the experts' (dikkat.layers.moe)
        constants = {name: tensors[path] for name, path in entry["constants"].items()}
        try:
            runner = _runner(self.package)
            if set(runner.get_constant_fqns()) != set(constants):
                raise RuntimeError("its constants are not the ones its record names")
            # (constants, use the inactive buffer, check every one is given, user-managed, h2d)
            runner.load_constants(constants, False, True, True, False)
        except RuntimeError as e:  # the loader's errors: a package this PyTorch cannot run
            print(f"dikkat: the compiled step {self.package.name} does not load "
                  f"({_first_line(e)}); compiling it again", file=sys.stderr)  # fmt: skip
            return None
        return Bound(runner, constants, dict(entry["constants"]))

    def _compile(self) -> None:
        print(f"dikkat: compiling the {'batch ' if self.kind == 'pool' else ''}decode step of "
              "this model for this machine (once; a minute or so) …", file=sys.stderr,
              flush=True)  # fmt: skip
        start = time.perf_counter()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.folder, prefix=".build-") as tmp:
                built = Path(tmp) / self.package.name
                where = self._built(built)
                entry = {"version": VERSION, "lineage": self.lineage, "package": record(built),
                         "constants": where}  # fmt: skip
                # the package first, its record after: a crash between leaves a record that
                # does not match, and the next load compiles again
                atomic_write(self.package, lambda to: shutil.copyfile(built, to))
                write_text(self.record_path, json.dumps(entry, indent=1))
        except OSError as e:  # a full disk, a folder not writable: not the model's failing
            raise StepCompileError(f"the cache cannot keep it: {_first_line(e)}") from e
        self.built = True
        print(f"dikkat: compiled in {time.perf_counter() - start:.0f} s, kept in "
              f"{self.package}", file=sys.stderr)  # fmt: skip
        freed = prune(self.folder, self.lineage, self.package)
        if freed:
            print(f"dikkat: removed {freed / 2**20:.1f} MiB of this model's compiled steps "
                  "from older versions", file=sys.stderr)  # fmt: skip

    def _built(self, package: Path) -> dict[str, str]:
        """:meth:`_build`, a failure of the model's (not of the disk) recorded, so that the
        next decode of the model goes eager at once instead of compiling for a minute again."""
        try:
            return self._build(package)
        except OSError:
            raise
        except Exception as e:  # export's and inductor's errors have no common base
            reason = str(e) if isinstance(e, StepCompileError) else _first_line(e)
            with contextlib.suppress(OSError):  # not recorded: the next decode tries again
                failed = {"version": VERSION, "lineage": self.lineage, "failed": reason}
                write_text(self.record_path, json.dumps(failed))
            raise StepCompileError(reason) from e

    def _build(self, package: Path) -> dict[str, str]:
        """Export and compile the step into ``package``; returns each constant's path in the
        model."""
        fetched: dict[str, Tensor] = {}

        def note_constants(graph: torch.fx.Graph) -> None:
            root = graph.owning_module
            for node in graph.find_nodes(op="get_attr"):
                value: Any = root
                for part in str(node.target).split("."):
                    value = getattr(value, part)
                if isinstance(value, Tensor):
                    fetched[str(node.target)] = value

        import torch._inductor  # the compiler, for a build alone

        module = _StepModule(self.model, self.windows, self.step)
        example, dynamic = self.inputs()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # export's and inductor's notes on their internals
            program = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
            torch._inductor.aoti_compile_and_package(
                program,
                package_path=str(package),
                inductor_configs={
                    "aot_inductor.package_constants_in_so": False,
                    "post_grad_custom_post_pass": note_constants,
                },
            )
        paths = {_identity(t): path for path, t in tensors_of(self.model).items()}
        where: dict[str, str] = {}
        # the constants the package asks for: of those the graph fetched, the ones inductor did
        # not write into its code (a tensor of a few numbers) nor find the same as another (a
        # tied one)
        for name in _runner(package).get_constant_fqns():
            t = fetched.get(name)
            path = None if t is None else paths.get(_identity(t))
            if t is None or path is None:
                raise StepCompileError(
                    f"the compiled step reads a tensor {name} that is none of the model's"
                )
            where[name] = path
        return where


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
