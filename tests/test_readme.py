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
