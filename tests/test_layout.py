"""The shape of the source tree: imports between packages flow one way, files stay small.

The order (README, "Layout"): core (the kernels beside it) → layers → weights → generation →
models / serving → interop / vision / hf → pretrained → tasks / audit / maps → training → cli,
with bench beside (only the command line imports it), viz a leaf that draws (it imports nothing
of the model stack, only files), and the one-file utilities (files, runs, validate, presets,
seeds, text) where their imports put them (:data:`TIERS`). A package may import only packages of
a lower tier — counting imports inside functions, which hide a circle without removing it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dikkat"
MAX_LINES = 400

# every unit of the package, lowest first; a unit imports only units of lower tiers
TIERS: tuple[frozenset[str], ...] = tuple(
    frozenset(t.split())
    for t in (
        "validate version files presets",
        "core kernels runs viz",
        "masks layers text functional",
        "weights",  # the formats' layers over layers.linear, their kernels; generation uses them
        "generation seeds distributed",
        "models serving",  # the engine and the server need the decoder protocol, no model class
        "interop vision hf",
        "pretrained",
        "tasks audit maps",
        "training bench",
        "cli",
        "dikkat __main__",
    )
)


def _unit(module: str) -> str:
    """dikkat.core.tiled.plan → core; dikkat.files → files; dikkat → dikkat."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dikkat"


def _module_of(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
    base = SRC.parent / module.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def import_graph() -> dict[str, dict[str, list[str]]]:
    """unit → {imported unit: ["file:line", …]}, for every import of one dikkat unit by another
    (the package itself, ``dikkat``, is a unit too: its ``__init__`` imports every part, so a
    part that imports a name from it closes a circle)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(SRC.rglob("*.py")):
        here = _unit(_module_of(path))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from a import b`: module a.b if there is one, else a name defined in a
                names = [
                    f"{node.module}.{a.name}" if _exists(f"{node.module}.{a.name}") else node.module
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if not name.startswith("dikkat."):
                    continue
                while name and not _exists(name):
                    name = name.rpartition(".")[0]
                there = _unit(name) if name else None
                if there and there != here:
                    graph[here][there].append(f"{path.relative_to(SRC)}:{node.lineno}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_packages():
    graph = import_graph()
    circles = cycles(graph)
    where = {
        tuple(c): {f"{a} → {b}": graph[a][b][:2] for a in c for b in c if b in graph.get(a, {})}
        for c in circles
    }
    assert not circles, where


def test_every_import_goes_down_the_tiers():
    tier = {unit: i for i, units in enumerate(TIERS) for unit in units}
    graph = import_graph()
    units = set(graph) | {b for a in graph for b in graph[a]}
    assert units <= set(tier), f"place the new units in TIERS: {sorted(units - set(tier))}"
    upward = {
        f"{a} → {b}": where[:2]
        for a in graph
        for b, where in graph[a].items()
        if tier[b] >= tier[a]
    }
    assert not upward, upward


def test_the_core_imports_nothing_above_it():
    graph = import_graph()
    assert set(graph.get("core", {})) <= {"validate"}, dict(graph["core"])


def test_the_kernels_import_nothing_but_the_utilities():
    graph = import_graph()
    assert set(graph.get("kernels", {})) <= {"validate", "files"}, dict(graph["kernels"])


def test_no_source_file_holds_two_ideas():
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_checker_finds_a_circle():
    graph = {"a": {"b": ["x.py:1"]}, "b": {"c": ["y.py:2"]}, "c": {"a": ["z.py:3"]}, "d": {}}
    assert cycles(graph) == [["a", "b", "c"]]


def module_graph(src: Path = SRC) -> dict[str, dict[str, list[str]]]:
    """module → {imported module: ["file:line", …]}, between the modules of ``src`` (a package's
    ``__init__`` is the package's module), counting every import: at the top, inside functions
    and under ``if TYPE_CHECKING:`` (a circle hidden there is still one the reader follows, and
    the checker of types too). ``from a import b`` is module a.b where there is one, else a."""

    def module_of(path: Path) -> str:
        parts = path.relative_to(src.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def exists(module: str) -> bool:
        base = src.parent / module.replace(".", "/")
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(src.rglob("*.py")):
        here = module_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [
                    f"{node.module}.{a.name}" if exists(f"{node.module}.{a.name}") else node.module
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] != src.name:
                    continue
                while name and not exists(name):
                    name = name.rpartition(".")[0]
                if name and name != here:
                    graph[here][name].append(f"{path.relative_to(src)}:{node.lineno}")
    return graph


def test_no_import_circle_between_modules():
    """Not only between packages: dikkat.models.decoder → generating → static_step → decoder
    was a circle inside one package, behind ``TYPE_CHECKING``."""
    graph = module_graph()
    circles = cycles(graph)
    where = {
        tuple(c): {f"{a} → {b}": graph[a][b][:2] for a in c for b in c if b in graph.get(a, {})}
        for c in circles
    }
    assert not circles, where


def capability_lookups(src: Path = SRC) -> list[str]:
    """``getattr(…, "…_step")`` and ``hasattr(…, "…_step")`` in ``src``: a decode step found by
    its name rather than declared (the steps are :class:`dikkat.generation.DecoderLM`'s)."""
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and node.args[1].value.endswith("_step")
            ):
                found.append(f"{path.relative_to(src)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_decode_step_is_looked_up_by_name():
    assert not capability_lookups(), capability_lookups()


ATTENTION = "layers/attention.py"  # the one definition of a layer's attention forward
ROPE = "layers/positional.py"  # RoPE's own module: angles and rotate_half are defined there


def second_attention_forwards(src: Path = SRC) -> list[str]:
    """What writes a layer's self-attention forward outside ``layers/attention.py``
    (:meth:`MultiHeadAttention.project` and :meth:`~MultiHeadAttention.merge` there). Such a
    forward has to do one of these, each caught here:

    1. call the fused projection: ``<expr>.qkv_proj(…)`` (reading the attribute is fine: the
       loaders swap the layer, the state-dict hooks split its weight);
    2. split activations into q, k and v: a ``.split(…)`` whose arguments mention
       ``qkv_sizes`` along the last dim (``dim=-1``; the state-dict hooks split a weight's rows,
       dim 0);
    3. apply RoPE itself: call ``rotate_half(…)`` or a RoPE's ``.angles(…)`` (outside
       ``layers/positional.py``, where they are defined and :meth:`RotaryEmbedding.rotate`
       calls them).
    """
    found = []
    for path in sorted(src.rglob("*.py")):
        where = str(path.relative_to(src).as_posix())
        if where == ATTENTION:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            text = ast.unparse(node)
            last_dim = any(
                k.arg == "dim" and ast.unparse(k.value) == "-1" for k in node.keywords
            ) or (len(node.args) > 1 and ast.unparse(node.args[1]) == "-1")
            split = name == "split" and last_dim and "qkv_sizes" in ast.unparse(node.args[:1])
            rope = name in ("rotate_half", "angles") and where != ROPE
            if name == "qkv_proj" or split or rope:
                found.append(f"{where}:{node.lineno} {text[:80]}")
    return found


def test_one_definition_of_a_layers_attention_forward():
    """The training forward, the eager decode, the static step and the engine's pool step all
    run :meth:`dikkat.layers.MultiHeadAttention.forward`; only what stores the keys and values
    and attends differs (:class:`dikkat.layers.kv_cache.AttendingCache`)."""
    found = second_attention_forwards()
    assert not found, found
