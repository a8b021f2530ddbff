"""``import dikkat`` loads the attention core, the layers, generation and the models, and nothing
heavier; every other public name is loaded on first use and reachable as ``dikkat.NAME`` and
``from dikkat import NAME`` (PEP 562, ``dikkat.__getattr__``).

Each check runs in a fresh interpreter: in this one, other tests have long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

# loaded by the first use of one of their names, never by `import dikkat`
NOT_ON_IMPORT = (
    "dikkat.audit",
    "dikkat.bench",
    "dikkat.cli",
    "dikkat.distributed",
    "dikkat.hf",
    "dikkat.interop",
    "dikkat.maps",
    "dikkat.pretrained",
    "dikkat.serving",
    "dikkat.tasks",
    "dikkat.text",
    "dikkat.training",
    "dikkat.vision",
    "dikkat.viz",
    "fastapi",
    "jinja2",
    "matplotlib",
    "scipy",
    "tokenizers",
    "transformers",
    "uvicorn",
    # the compiler's stack: a second of every start-up, for programs that never compile
    "torch._dynamo",
    "torch._inductor",
    "torch.fx.experimental.symbolic_shapes",
)


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_dikkat_loads_only_the_core_layers_generation_and_models():
    loaded = set(
        json.loads(run_python("import sys, json, dikkat; print(json.dumps(list(sys.modules)))"))
    )
    assert {"dikkat.core", "dikkat.layers", "dikkat.generation", "dikkat.models"} <= loaded
    assert not loaded & set(NOT_ON_IMPORT), sorted(loaded & set(NOT_ON_IMPORT))


def test_every_public_name_resolves_by_attribute_and_by_from_import():
    """Walk ``dikkat.__all__`` in a fresh process: ``from dikkat import NAME`` (the lazy path
    for a name not yet loaded), then ``dikkat.NAME`` gives the same object, which is the one its
    own module defines; ``dir(dikkat)`` lists every name, and ``from dikkat import *`` works."""
    code = """
import importlib, json
import dikkat

out = {"missing": [], "differ": [], "not_in_dir": []}
for name in dikkat.__all__:
    space = {}
    try:
        exec(f"from dikkat import {name}", space)
    except ImportError as e:
        out["missing"].append(f"{name}: {e}")
        continue
    value = getattr(dikkat, name)
    home = dikkat._LAZY_NAMES.get(name)
    defined = value if home is None else getattr(importlib.import_module(home), name)
    if space[name] is not value or defined is not value:
        out["differ"].append(name)
    if name not in dir(dikkat):
        out["not_in_dir"].append(name)
exec("from dikkat import *", {})
print(json.dumps(out))
"""
    out = json.loads(run_python(code))
    assert out == {"missing": [], "differ": [], "not_in_dir": []}, out


def test_every_part_of_dikkat_is_an_attribute_once_asked_for():
    """After a bare ``import dikkat``, ``dikkat.vision.ViT`` works as it did when every part was
    imported eagerly: the attribute is the subpackage itself, imported on first use."""
    code = """
import importlib, json
import dikkat
parts = dikkat._LAZY_MODULES
same = {p: getattr(dikkat, p) is importlib.import_module(f"dikkat.{p}") for p in parts}
print(json.dumps({"same": same, "dir": sorted(set(parts) - set(dir(dikkat)))}))
"""
    out = json.loads(run_python(code))
    assert {"audit", "serving", "training", "vision", "viz"} <= out["same"].keys()
    assert all(out["same"].values()) and out["dir"] == [], out


def test_an_unknown_name_is_an_attribute_error_naming_it():
    code = """
import dikkat
try:
    dikkat.no_such_name
except AttributeError as e:
    print(e)
"""
    assert run_python(code).strip() == "module 'dikkat' has no attribute 'no_such_name'"
