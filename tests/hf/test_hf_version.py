"""The oldest transformers dikkat.hf runs on is one version everywhere: ``dikkat.hf.
MIN_TRANSFORMERS``, pyproject.toml's ``hf`` and ``dev`` extras, the docs and docstrings that state
a version, and what ``.ci/hf_floor`` installs; ``register`` refuses anything older (docs/hf.md,
"Which transformers")."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dikkat.hf
from dikkat.hf import MIN_TRANSFORMERS

ROOT = Path(__file__).resolve().parents[2]
# a stated version: "transformers (≥ 5.24.0", "transformers ≥ 5.24.0", "transformers>=5.24.0",
# "transformers==5.24.0" — not sentence-transformers'
STATED = re.compile(r"(?<![\w-])transformers\s*\(?\s*(?:≥|>=|==)\s*([0-9][0-9.]*[0-9])")


def _texts() -> dict[str, str]:
    paths = [ROOT / "pyproject.toml", ROOT / "README.md", ROOT / "Makefile"]
    paths += sorted((ROOT / "docs").glob("*.md"))
    paths += sorted((ROOT / "src").rglob("*.py"))
    paths += sorted((ROOT / ".ci").iterdir())
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths}


def test_the_extras_require_the_floor() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["hf"] == [f"transformers>={MIN_TRANSFORMERS}"]
    dev = [r for r in extras["dev"] if re.match(r"transformers\b", r)]
    assert dev == [f"transformers>={MIN_TRANSFORMERS}"]


def test_every_stated_version_is_the_floor() -> None:
    stated = {(path, m.group(1)) for path, text in _texts().items() for m in STATED.finditer(text)}
    assert {path for path, _ in stated} >= {"pyproject.toml", "docs/hf.md"}
    assert sorted(s for s in stated if s[1] != MIN_TRANSFORMERS) == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="the CI script is a bash script")
def test_the_ci_check_installs_the_floor() -> None:
    """.ci/hf_floor reads the version from pyproject.toml's hf extra (``--floor`` prints it)."""
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "hf_floor"), "--floor"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == MIN_TRANSFORMERS


def _older(version: str) -> str:
    """The release before ``version``'s minor series: 5.24.0 → 5.23.0."""
    major, minor = (int(p) for p in version.split(".")[:2])
    return f"{major}.{minor - 1}.0" if minor else f"{major - 1}.99.0"


@pytest.mark.parametrize("register", [dikkat.hf.register, dikkat.hf.register_ring])
def test_register_refuses_an_older_transformers(register, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    old = _older(MIN_TRANSFORMERS)
    monkeypatch.setattr(transformers, "__version__", old)
    with pytest.raises(ImportError) as e:
        register("dikkat-too-old")
    message = str(e.value)
    assert f"transformers {old} is installed" in message
    assert f"needs transformers ≥ {MIN_TRANSFORMERS}" in message
    assert f"pip install 'transformers>={MIN_TRANSFORMERS}'" in message
    assert "dikkat-too-old" not in transformers.AttentionInterface()
    monkeypatch.setattr(transformers, "__version__", MIN_TRANSFORMERS)
    assert register("dikkat-at-the-floor") == "dikkat-at-the-floor"


def test_register_without_transformers_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # how Python marks a module absent
    with pytest.raises(ImportError, match=f"transformers>={re.escape(MIN_TRANSFORMERS)}"):
        dikkat.hf.register("dikkat-no-transformers")
