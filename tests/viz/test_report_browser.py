"""The HTML report in a real browser: headless Chromium driven by Selenium.

Uses the system's Chromium and its driver (Debian's ``chromium`` and ``chromium-driver``, which
.ci/run installs); skips, saying what is missing, where either or selenium is absent. Selenium's
own driver download (Selenium Manager) is never used: this machine may have no network, and the
test must run the browser it was given.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from report_cases import HOSTILE, report_maps

from dikkat.viz import write_html
from dikkat.viz.report import SCALE

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
MIN_WEIGHT = 0.01  # the faintest line the head view draws (report.js)

for _tool, _package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
    if not _tool.is_file():
        pytest.skip(
            f"{_tool} is missing: install Debian's {_package} (.ci/run does) to run the HTML "
            "report in a browser",
            allow_module_level=True,
        )
webdriver = pytest.importorskip(
    "selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')"
)
from selenium.common.exceptions import TimeoutException, WebDriverException  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.selenium_manager import SeleniumManager  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


class Page:
    """The report open in one browser for the whole module; :meth:`fresh` reloads it."""

    def __init__(self, driver: Any, url: str) -> None:
        self.driver = driver
        self.url = url

    def fresh(self) -> Any:
        self.driver.get(self.url)
        try:
            WebDriverWait(self.driver, 10).until(
                lambda d: d.execute_script("return document.documentElement.dataset.ready")
            )
        except TimeoutException:
            pytest.fail(f"the report's script did not finish; console errors: {self.severe()}")
        return self.driver

    def severe(self) -> list[dict[str, Any]]:
        """The console's errors since the last call (an uncaught exception is one)."""
        return [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def lines(self) -> list[tuple[int, int, int, float]]:
        """(query, key, head index, opacity) of every line the head view draws, in order."""
        rows = self.driver.execute_script(
            "return [...document.querySelectorAll('#lines line')].map(l => [+l.dataset.q, "
            "+l.dataset.k, +l.dataset.h, +l.getAttribute('stroke-opacity')])"
        )
        return [tuple(r) for r in rows]

    def count(self, css: str) -> int:
        return len(self.driver.find_elements(By.CSS_SELECTOR, css))

    def dimmed(self) -> list[bool]:
        return self.driver.execute_script(
            "return [...document.querySelectorAll('#lines line')]"
            ".map(l => l.classList.contains('dim'))"
        )


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    path = write_html(report_maps(), tmp_path_factory.mktemp("report") / "report.html")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,1000"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with pytest.MonkeyPatch.context() as mp:
        # with the driver named, Selenium skips its manager; make sure it stays so
        def no_manager(*_: object) -> None:
            raise AssertionError("Selenium Manager was called: it must use /usr/bin/chromedriver")

        mp.setattr(SeleniumManager, "binary_paths", no_manager)
        try:
            driver = webdriver.Chrome(
                service=webdriver.ChromeService(str(CHROMEDRIVER)), options=options
            )
        except WebDriverException as e:
            pytest.fail(f"Chromium would not start under chromedriver: {e.msg}")
        try:
            yield Page(driver, path.as_uri())
        finally:
            driver.quit()


def expected_lines(layer: int) -> list[tuple[int, int, int, float]]:
    """The lines report.js should draw for ``layer`` with every head shown, from the weights."""
    w = np.rint(report_maps().weights[layer].astype(np.float64) * SCALE) / SCALE  # as stored
    H, Tq, Tk = w.shape
    return [
        (i, j, h, float(w[h, i, j]))
        for h in range(H) for i in range(Tq) for j in range(Tk) if w[h, i, j] >= MIN_WEIGHT
    ]  # fmt: skip


def close(got: list[tuple[int, int, int, float]], want: list[tuple[int, int, int, float]]) -> bool:
    return len(got) == len(want) and all(
        g[:3] == w[:3] and abs(g[3] - w[3]) < 1e-6 for g, w in zip(got, want, strict=True)
    )


def test_the_page_is_drawn_without_errors(page: Page) -> None:
    d = page.fresh()
    assert page.severe() == []
    maps = report_maps()
    assert page.count(".token.q") == 5 and page.count(".token.k") == 6
    assert page.count("#heads input[type=checkbox]:checked") == 3
    assert page.count("#layer option") == 2 and page.count("canvas.cell") == 6
    assert [e.text for e in d.find_elements(By.CSS_SELECTOR, ".head-label")] == [
        "head 0", "head 2", "head 4",
    ]  # fmt: skip
    assert close(page.lines(), expected_lines(0))
    assert len(page.lines()) > 40  # most of the 3 × 5 × 6 weights are drawn
    assert maps.kind in d.find_element(By.ID, "kind").text


def test_the_console_check_sees_a_script_error(page: Page) -> None:
    page.driver.get("data:text/html,<script>throw new Error('broken on purpose')</script>")
    assert any("broken on purpose" in e["message"] for e in page.severe())


def test_hostile_labels_show_as_text(page: Page) -> None:
    d = page.fresh()
    shown = d.execute_script(
        "return [...document.querySelectorAll('.token.q text')].map(t => t.textContent)"
    )
    assert shown == [*HOSTILE, "x"]
    assert d.find_elements(By.CSS_SELECTOR, ".token.k text")[2].text == HOSTILE[0]
    assert d.execute_script("return typeof window.pwned") == "undefined"  # no onerror ran
    assert d.find_elements(By.CSS_SELECTOR, "main b, main img, main i") == []
    assert d.title == "<i>hostile</i> & co"
    assert d.find_element(By.ID, "title").text == "<i>hostile</i> & co"
    assert page.severe() == []


@pytest.mark.parametrize(("side", "index", "field"), [("q", 1, 0), ("k", 4, 1)])
def test_hovering_a_token_keeps_only_its_lines(
    page: Page, side: str, index: int, field: int
) -> None:
    d = page.fresh()
    assert not any(page.dimmed())
    token = d.find_element(By.CSS_SELECTOR, f".token.{side}[data-index='{index}']")
    d.execute_script("arguments[0].scrollIntoView({block: 'center'})", token)
    ActionChains(d).move_to_element(token).perform()
    lines, dimmed = page.lines(), page.dimmed()
    assert any(dimmed) and not all(dimmed)
    assert all(dim == (line[field] != index) for line, dim in zip(lines, dimmed, strict=True))
    assert "focus" in token.get_attribute("class")
    opacity = d.execute_script(
        "const ls = [...document.querySelectorAll('#lines line')];"
        "return [ls.find(l => l.classList.contains('dim')),"
        " ls.find(l => !l.classList.contains('dim'))]"
        ".map(l => +getComputedStyle(l).opacity)"
    )
    assert opacity[0] < 0.2 < opacity[1] == 1
    ActionChains(d).move_to_element(d.find_element(By.ID, "title")).perform()
    assert not any(page.dimmed()) and "focus" not in token.get_attribute("class")
    assert page.severe() == []


def test_the_layer_menu_and_head_boxes_change_the_lines(page: Page) -> None:
    d = page.fresh()
    assert close(page.lines(), expected_lines(0))
    Select(d.find_element(By.ID, "layer")).select_by_index(1)
    assert close(page.lines(), expected_lines(1)) and not close(page.lines(), expected_lines(0))
    d.find_element(By.CSS_SELECTOR, "#heads input[data-head='1']").click()  # hide head 2
    want = [line for line in expected_lines(1) if line[2] != 1]
    assert close(page.lines(), want) and len(want) < len(expected_lines(1))
    assert page.severe() == []


def test_a_click_on_a_heat_map_shows_that_head(page: Page) -> None:
    d = page.fresh()
    d.find_element(By.CSS_SELECTOR, "canvas.cell[data-layer='1'][data-head='2']").click()
    assert d.find_element(By.ID, "layer").get_attribute("value") == "1"
    boxes = d.find_elements(By.CSS_SELECTOR, "#heads input")
    assert [b.is_selected() for b in boxes] == [False, False, True]
    assert close(page.lines(), [line for line in expected_lines(1) if line[2] == 2])
    selected = d.find_elements(By.CSS_SELECTOR, "canvas.cell.selected")
    assert [(c.get_attribute("data-layer"), c.get_attribute("data-head")) for c in selected] == [
        ("1", "2")
    ]
    assert page.severe() == []


def pixels(png: bytes) -> np.ndarray:
    """An (h, w, 3) float array in [0, 1] from PNG bytes (matplotlib decodes PNG itself)."""
    from matplotlib import image

    return np.asarray(image.imread(io.BytesIO(png), format="png"))[..., :3]


def test_the_screenshot_is_not_blank(page: Page) -> None:
    d = page.fresh()
    whole = pixels(d.get_screenshot_as_png())
    assert whole.std() > 0.05 and (whole.mean(-1) < 0.9).mean() > 0.01
    heat = pixels(d.find_element(By.CSS_SELECTOR, "canvas.cell").screenshot_as_png)
    inside = heat[3:-3, 3:-3]  # without the border
    assert inside.std() > 0.05  # weights of different sizes, painted in different shades
    assert (inside.mean(-1) < 0.95).mean() > 0.1


@pytest.fixture(scope="module")
def opened(page: Page, tmp_path_factory: pytest.TempPathFactory) -> Page:
    """The report as `dikkat show --token … --layer …` writes it: opening on query row 1, the
    second layer and head 2 alone (of heads 0, 2, 4)."""
    path = tmp_path_factory.mktemp("opened") / "report.html"
    write_html(report_maps(), path, focus=1, layer=1, heads=[2])
    return Page(page.driver, path.as_uri())


def checked(d: Any) -> list[bool]:
    return [b.is_selected() for b in d.find_elements(By.CSS_SELECTOR, "#heads input")]


def mode(d: Any) -> str | None:
    on = d.find_elements(By.CSS_SELECTOR, "input[name='head-mode']:checked")
    return on[0].get_attribute("value") if on else None


def test_the_page_opens_on_the_token_layer_and_head_asked_for(opened: Page) -> None:
    d = opened.fresh()
    assert opened.severe() == []
    assert Select(d.find_element(By.ID, "layer")).first_selected_option.text == "layer 1"
    token = Select(d.find_element(By.ID, "token")).first_selected_option
    assert token.get_attribute("value") == "q:1" and "position 4" in token.text
    assert checked(d) == [False, True, False] and mode(d) == "one"
    want = [line for line in expected_lines(1) if line[0] == 1 and line[2] == 1]
    assert want and close(opened.lines(), want)  # its lines alone: no tangle
    shown = d.execute_script(
        "return [...document.querySelectorAll('#lines line')].map(l => getComputedStyle(l))"
        ".map(s => s.display !== 'none' && s.visibility === 'visible' && +s.opacity === 1)"
    )
    assert shown and all(shown)
    assert not any(opened.dimmed())
    picked = d.find_elements(By.CSS_SELECTOR, ".token.picked")
    assert [(p.get_attribute("class"), p.get_attribute("data-index")) for p in picked] == [
        ("token q picked", "1")
    ]
    assert d.find_element(By.ID, "heat-title").text == "layer 1 · head 2"
    selected = d.find_elements(By.CSS_SELECTOR, "canvas.cell.selected")
    assert [(c.get_attribute("data-layer"), c.get_attribute("data-head")) for c in selected] == [
        ("1", "1")
    ]


def test_the_heat_map_has_the_tokens_on_its_axes(opened: Page) -> None:
    d = opened.fresh()
    maps = report_maps()
    for side, labels in (("q", maps.queries), ("k", maps.keys)):
        shown = d.find_elements(By.CSS_SELECTOR, f"#heat-map .heat-label.{side}")
        assert [t.get_attribute("textContent") for t in shown] == list(labels)
        assert all(t.is_displayed() for t in shown)
    # each query label beside its row of the map, each key label under its column
    image = d.find_element(By.CSS_SELECTOR, "#heat-map image").rect
    rows = [t.rect for t in d.find_elements(By.CSS_SELECTOR, "#heat-map .heat-label.q")]
    cols = [t.rect for t in d.find_elements(By.CSS_SELECTOR, "#heat-map .heat-label.k")]
    step = image["height"] / len(rows)
    for i, r in enumerate(rows):
        assert r["x"] + r["width"] <= image["x"] + 1
        assert abs(r["y"] + r["height"] / 2 - (image["y"] + (i + 0.5) * step)) < step / 2
    for j, c in enumerate(cols):
        assert c["y"] >= image["y"] + image["height"] - 1
        assert abs(c["x"] + c["width"] / 2 - (image["x"] + (j + 0.5) * step)) < step / 2
    bold = d.find_elements(By.CSS_SELECTOR, "#heat-map .heat-label.picked")
    assert [t.get_attribute("textContent") for t in bold] == [maps.queries[1]]
    heat = pixels(d.find_element(By.CSS_SELECTOR, "#heat-map image").screenshot_as_png)
    assert heat.std() > 0.05  # painted, not blank
    assert opened.severe() == []


def test_all_one_and_none_heads(opened: Page) -> None:
    d = opened.fresh()
    radio = {m.get_attribute("value"): m for m in d.find_elements(By.NAME, "head-mode")}
    radio["all"].click()
    assert checked(d) == [True, True, True] and mode(d) == "all"
    assert close(opened.lines(), [line for line in expected_lines(1) if line[0] == 1])
    radio["none"].click()
    assert checked(d) == [False, False, False] and opened.lines() == []
    radio["one"].click()
    assert checked(d) == [True, False, False]
    d.find_element(By.CSS_SELECTOR, "#heads input[data-head='2']").click()  # one: it alone
    assert checked(d) == [False, False, True] and mode(d) == "one"
    assert d.find_element(By.ID, "heat-title").text == "layer 1 · head 4"
    radio["all"].click()
    d.find_element(By.CSS_SELECTOR, "#heads input[data-head='0']").click()  # all: a toggle
    assert checked(d) == [False, True, True] and mode(d) is None
    assert opened.severe() == []


def test_the_token_menu_and_a_click_pick_the_token(opened: Page) -> None:
    d = opened.fresh()
    menu = Select(d.find_element(By.ID, "token"))
    menu.select_by_value("")  # every token
    assert close(opened.lines(), [line for line in expected_lines(1) if line[2] == 1])
    key = d.find_element(By.CSS_SELECTOR, ".token.k[data-index='3']")
    d.execute_script("arguments[0].scrollIntoView({block: 'center'})", key)
    key.click()
    assert menu.first_selected_option.get_attribute("value") == "k:3"
    assert close(opened.lines(), [ln for ln in expected_lines(1) if ln[1] == 3 and ln[2] == 1])
    key.click()  # again: every token
    assert menu.first_selected_option.get_attribute("value") == ""
    assert opened.severe() == []
