"""Every script in benchmarks/ answers --help with its usage, without running anything."""

import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted(
    p
    for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")
    if p.stem != "common"
)


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_help_prints_usage_and_exits(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
