"""The HTML report without a browser: one well-formed, self-contained file whose embedded data
are the weights, with every label escaped; too-large reports refused; written atomically.
(tests/viz/test_report_browser.py runs the page in Chromium.)"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from report_cases import HOSTILE, report_maps

from dikkat.viz import write_html
from dikkat.viz.report import SCALE

VOID = {"meta", "link", "input", "br", "img", "hr"}


class Page(HTMLParser):
    """Every tag, attribute and script of a page; fails on a tag closed out of order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: dict[str | None, str] = {}
        self.text: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open[-1:]}"
        self.open.pop()

    def handle_data(self, data: str) -> None:
        if self.open and self.open[-1] in ("script", "title"):
            key = self.tags[-1][1].get("id") if self.open[-1] == "script" else "title"
            target = self.scripts if self.open[-1] == "script" else self.text
            target[key] = target.get(key, "") + data


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    assert page.open == [], f"unclosed tags {page.open}"
    return page


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Page]:
    path = write_html(report_maps(), tmp_path_factory.mktemp("report") / "report.html")
    return path, parse(path)


def test_the_embedded_data_are_the_weights_and_labels(written: tuple[Path, Page]) -> None:
    _, page = written
    maps = report_maps()
    data = json.loads(page.scripts["dikkat-data"])
    L, H, Tq, Tk = maps.weights.shape
    stored = np.asarray(data["weights"], dtype=np.float64).reshape(L, H, Tq, Tk) / data["scale"]
    err = np.abs(stored - maps.weights.astype(np.float64))
    assert err.max() <= 0.5 / SCALE + 1e-7  # rounded to four decimal places, no worse
    assert err.max() > 0  # rounding did happen: the comparison is not of a value with itself
    assert data["queries"] == list(maps.queries) and data["keys"] == list(maps.keys)
    assert data["layers"] == list(maps.layers) and data["heads"] == [0, 2, 4]
    assert data["rows"] == [3, 4, 5, 6, 7] and data["kind"] == "cross"
    assert data["title"] == maps.title


def test_the_file_needs_nothing_from_outside(written: tuple[Path, Page]) -> None:
    path, page = written
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"https?:", text, flags=re.I)
    for tag, attrs in page.tags:
        for name in ("src", "href"):
            assert attrs.get(name) is None or attrs[name].startswith("data:"), (tag, attrs)
    assert [t for t, _ in page.tags].count("script") == 2  # the data and the inline script
    assert "JSON.parse" in page.scripts[None] and "<style>" in text


def test_hostile_labels_stay_inside_the_json(written: tuple[Path, Page]) -> None:
    path, page = written
    text = path.read_text(encoding="utf-8")
    for label in HOSTILE:
        assert label not in text
    assert text.count("</script") == 2 and text.count("<!--") == 0
    assert not any(tag in ("b", "img", "i") for tag, _ in page.tags)
    assert page.text["title"] == "<i>hostile</i> & co"  # escaped, and so read back as written


def test_title_and_kind(tmp_path: Path) -> None:
    path = write_html(report_maps(kind="self"), tmp_path / "r.html", title="mine")
    page = parse(path)
    assert page.text["title"] == "mine"
    data = json.loads(page.scripts["dikkat-data"])
    assert (data["title"], data["kind"]) == ("mine", "self")


def test_a_report_over_the_limit_is_refused_before_writing(tmp_path: Path) -> None:
    path = write_html(report_maps(), tmp_path / "r.html")
    size = path.stat().st_size
    write_html(report_maps(), path, max_bytes=size)  # exactly at the limit: written
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"3 layers × 3 heads × 5 × 6.*--layer/--head") as err:
        write_html(report_maps(layers=3), path, max_bytes=size)  # larger than the 2-layer one
    assert f"limit of {size:,} bytes (max_bytes={size})" in str(err.value)
    assert path.read_bytes() == before  # the old report is untouched
    with pytest.raises(ValueError, match="max_bytes"):  # refused from the weights alone
        write_html(report_maps(), tmp_path / "new.html", max_bytes=100)
    assert not (tmp_path / "new.html").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


def test_written_atomically(tmp_path: Path) -> None:
    path = tmp_path / "deeper" / "r.html"
    path.parent.mkdir()
    path.write_text("old")
    assert write_html(report_maps(), path) == path
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    blocked = tmp_path / "deeper" / "a-folder"
    blocked.mkdir()
    with pytest.raises(OSError):  # a folder in the way: the rename fails
        write_html(report_maps(), blocked)
    assert sorted(p.name for p in path.parent.iterdir()) == ["a-folder", "r.html"]  # no temp file


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="maps must be an AttentionMaps, got ndarray"):
        write_html(np.zeros((1, 1, 1, 1)), tmp_path / "r.html")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_bytes must be a positive integer, got 0"):
        write_html(report_maps(), tmp_path / "r.html", max_bytes=0)


def test_what_the_page_opens_on(tmp_path: Path) -> None:
    """focus, layer and heads (head numbers) become indices into the maps' axes."""
    path = write_html(report_maps(), tmp_path / "r.html", focus=-1, layer=1, heads=[4, 0])
    data = json.loads(parse(path).scripts["dikkat-data"])
    assert data["open"] == {"focus": 4, "layer": 1, "heads": [0, 2]}  # heads 0, 2, 4 kept
    path = write_html(report_maps(), tmp_path / "r.html")
    data = json.loads(parse(path).scripts["dikkat-data"])
    assert data["open"] == {"focus": None, "layer": 0, "heads": [0, 1, 2]}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(focus=5), ValueError, r"focus must be an index into the 5 query rows, got 5"),
        (dict(focus=True), ValueError, "focus must be an index"),
        (dict(layer=-3), ValueError, r"layer must be an index into the 2 layers, got -3"),
        (dict(heads=[1]), ValueError, r"heads \[1\] are not among the maps' heads \[0, 2, 4\]"),
        (dict(heads="0"), TypeError, "heads must be a sequence of head numbers"),
    ],
)
def test_a_view_the_maps_do_not_have_is_refused(tmp_path: Path, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        write_html(report_maps(), tmp_path / "r.html", **kwargs)
    assert not (tmp_path / "r.html").exists()
