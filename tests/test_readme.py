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


def test_every_stated_training_recipe_is_the_registry_s():
    """A `dikkat train --task NAME --flag value …` line in the README, BENCHMARKS.md or docs/
    states the recipe: each value it gives equals the task's recipe in the registry."""
    import shlex

    from dikkat.cli import build_parser
    from dikkat.tasks import task_info

    root = README.parent
    pages = [README, root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md"))]
    parser = build_parser()
    checked = 0
    for page in pages:
        for line in re.findall(r"`(dikkat train --task [^`|]+)`", page.read_text()):
            argv = shlex.split(line)[1:]
            args = parser.parse_args(argv)
            recipe = task_info(args.task).training()
            for flag in ("--steps", "--batch-size", "--lr"):
                if flag in argv:
                    key = flag[2:].replace("-", "_")
                    assert getattr(args, key) == recipe[key], (page.name, line, key, recipe)
                    checked += 1
    assert checked >= 3  # the translator's recipe at least
