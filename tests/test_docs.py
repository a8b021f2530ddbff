"""Every Python example of the README and of every docs/ page runs, as written.

The ```python (or ```py) blocks of one page run in order, in one namespace, as a reader going
down the page would run them, in an empty working folder (nothing lands in the checkout). Two
HTML comments, invisible on the rendered page, steer this:

- ``<!-- no-test: why -->`` right before a block leaves that block out, saying why (it needs a
  GPU, a server, minutes of training …) — a few, each with its reason;
- ``<!-- invisible-code-block: python`` … ``-->`` is code run at that point of the page but not
  shown: what the prose says the reader already has (a Hugging Face model in ``model``, a
  process group), built small.

A page's examples may write files; everything they write must be a folder ``.gitignore``
leaves out (``runs/``, ``models/``), so that a reader who runs them from a checkout leaves it
clean.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# an HTML comment, or a fenced Python block (the comment's name, or the block's code)
PIECE = re.compile(
    r"<!--\s*(?P<comment>.*?)-->"
    r"|^```(?:python|py)\n(?P<code>.*?)^```",
    flags=re.S | re.M,
)
HIDDEN = "invisible-code-block: python"
NO_TEST = "no-test:"


@dataclass(frozen=True)
class Block:
    code: str
    line: int  # of the page, where the block starts
    shown: bool  # False: an invisible-code-block
    skipped: str = ""  # the reason of a no-test comment before it


def blocks_of(page: Path) -> list[Block]:
    """The Python blocks of ``page``, in order, hidden ones included."""
    text = page.read_text()
    out: list[Block] = []
    skip = ""
    end_of_skip = -1
    for m in PIECE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        comment = m.group("comment")
        if comment is not None:
            comment = comment.strip()
            if comment.startswith(HIDDEN):
                out.append(Block(comment[len(HIDDEN) :].strip("\n") + "\n", line, shown=False))
            elif comment.startswith(NO_TEST):
                skip, end_of_skip = comment[len(NO_TEST) :].strip(), m.end()
                assert skip, f"{page.name}:{line}: a no-test comment must say why"
            continue
        right_after = end_of_skip >= 0 and not text[end_of_skip : m.start()].strip()
        out.append(Block(m.group("code"), line, shown=True, skipped=skip if right_after else ""))
        skip, end_of_skip = "", -1
    return out


def run_page(page: Path) -> None:
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for block in blocks_of(page):
        if block.skipped:
            continue
        code = "\n" * block.line + block.code  # a traceback gives the page's own line numbers
        exec(compile(code, str(page), "exec"), namespace)


def ignored_by_git(path: str) -> bool:
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", path])
    return done.returncode == 0


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_page_s_python_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if not any(b.shown for b in blocks_of(page)):
        pytest.skip(f"{page.name} has no Python example")
    environment = dict(os.environ)
    sdpa = torch.nn.functional.scaled_dot_product_attention  # docs/attention.md swaps it
    try:
        run_page(page)
    finally:  # what a page sets up for a process group, or swaps in torch, stays with the page
        torch.nn.functional.scaled_dot_product_attention = sdpa
        os.environ.clear()
        os.environ.update(environment)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    for written in tmp_path.iterdir():
        assert ignored_by_git(written.name + ("/" if written.is_dir() else "")), (
            f"{page.name}'s examples write {written.name}, which .gitignore does not cover"
        )


def test_few_examples_are_left_out_and_each_says_why():
    skipped = [
        (page.name, b.line, b.skipped) for page in PAGES for b in blocks_of(page) if b.skipped
    ]
    shown = sum(b.shown for page in PAGES for b in blocks_of(page))
    assert shown >= 20, shown
    assert len(skipped) <= 4, skipped  # each one a reason to run it some other way


def test_the_parser_finds_blocks_markers_and_hidden_code(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- no-test: needs a GPU -->\n```py\ny = 2\n```\n"
        "<!-- invisible-code-block: python\nz = 3\n-->\n```sh\nnot python\n```\n"
        "<!-- a plain comment -->\n```python\nw = x + z\n```\n"
    )
    got = [(b.code, b.shown, b.skipped) for b in blocks_of(page)]
    assert got == [
        ("x = 1\n", True, ""),
        ("y = 2\n", True, "needs a GPU"),
        ("z = 3\n", False, ""),
        ("w = x + z\n", True, ""),
    ]
    run_page(page)
