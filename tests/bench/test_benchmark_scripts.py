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


def test_versions_compares_two_source_trees_in_alternated_processes(monkeypatch):
    """benchmarks/versions.py on the same tree twice: a table of ratios for every config."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    import versions

    src = Path(__file__).resolve().parents[2] / "src"
    configs = "causal@64,window16@64,doclen32@64"
    argv = [str(src), str(src), "--rounds", "1", "--calls", "1", "--configs", configs]
    table = versions.main(argv)
    assert set(table) == set(configs.split(","))
    assert all(row["old_ms"] > 0 and row["new_ms"] > 0 for row in table.values())
    with pytest.raises(SystemExit):
        versions.main([str(src / "dikkat"), str(src)])  # not a src folder
