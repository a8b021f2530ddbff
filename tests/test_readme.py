"""The README's API tour runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_tour_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tour saves a checkpoint under runs/
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python block"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"```sh\n(.*?)```", text, flags=re.S).group(1)
    assert "make demo" in first_block and "make test" in first_block


def test_every_command_line_of_the_readme_parses():
    """The README's `dikkat …` lines are valid command lines (parsed, not run)."""
    import shlex

    from dikkat.cli import build_parser

    parser = build_parser()
    lines = [
        line.split("  #")[0].strip()
        for block in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
        for line in block.splitlines()
        if line.startswith("dikkat ")
    ]
    assert len(lines) >= 10
    for line in lines:
        args = parser.parse_args(shlex.split(line)[1:])
        assert args.command is not None, line
