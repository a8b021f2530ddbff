"""The README: its command lines parse and run in order, what they write is ignored by git
(its Python examples run in tests/test_docs.py)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"```sh\n(.*?)```", text, flags=re.S).group(1)
    assert "make demo" in first_block and "make test" in first_block


def test_the_readme_says_where_the_dikkat_command_is():
    """`make` installs into .venv: the command line's section says how to reach `dikkat`."""
    section = README.read_text().split("## The command line", 1)[1].split("```sh", 1)[0]
    assert "source .venv/bin/activate" in section and ".venv/bin/dikkat" in section


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


def test_the_command_block_runs_top_to_bottom():
    """Followed in order, the README's command block never trains into a folder an earlier line
    filled (which `dikkat train` refuses without --overwrite or --resume) and never reads a run
    before the line that trains it: the folders each line makes and reads, parsed, not run."""
    import shlex

    from dikkat.cli import build_parser

    parser = build_parser()
    block = re.search(r"## The command line\n.*?```sh\n(.*?)```", README.read_text(), re.S)
    made: set[Path] = set()
    for line in block.group(1).splitlines():
        argv = shlex.split(line.split("  #")[0])[1:]
        args = parser.parse_args(argv)
        if args.command == "train":
            out = Path(args.out or f"runs/{args.task or 'lm'}")
            if args.resume:
                assert out in made, f"{line!r} resumes {out}, which no line before trained"
            else:
                assert args.overwrite or out not in made, f"{line!r} trains into {out} again"
            made.add(out)
        for name in ("run", "checkpoint"):
            read = getattr(args, name, None)
            if read is not None:
                assert Path(read) in made, f"{line!r} reads {read}, which no line before trained"


def test_what_the_examples_write_is_ignored_by_git():
    """The folders the README and docs/ write into, run from a checkout, are in .gitignore."""
    import subprocess

    for path in ("runs/gpt", "runs/show/minilm/attention.png", "models/gpt-tiny"):
        done = subprocess.run(
            ["git", "-C", str(README.parent), "check-ignore", "-q", "--no-index", path]
        )
        assert done.returncode == 0, f"{path} is not in .gitignore"


def test_no_example_writes_over_a_file_of_the_checkout():
    """What a README command writes (``--png``, ``--out``, ``--gguf``) goes to a place git
    ignores: running the README never changes a committed file (docs/img's pictures)."""
    import re
    import subprocess

    lines = [line for line in README.read_text().splitlines() if line.startswith("dikkat ")]
    written = [m for line in lines for m in re.findall(r"--(?:png|out|gguf)[ =](\S+)", line)]
    assert written, "the README's commands write nothing? the pattern has gone stale"
    for path in written:
        done = subprocess.run(
            ["git", "-C", str(README.parent), "check-ignore", "-q", "--no-index", path]
        )
        assert done.returncode == 0, f"a README command writes {path}, which git does not ignore"


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
