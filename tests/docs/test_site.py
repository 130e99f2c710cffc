"""The documentation site: it builds offline with ``mkdocs build --strict``, its formulas render in a real
browser, a newcomer finds the answers the issue names within two clicks of the home page, the README is a
front page, and nothing in the repository points at a contract outside it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK_START = (
    "make train    # creates .venv (CPU build of torch), installs rlcli, runs `rlcli train`",
    "make test     # the same set-up, then the whole test suite",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it (strict: a broken link or reference fails), into a fresh folder."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


class _Page(HTMLParser):
    """The links and the visible text of one built page."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.text: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.links.append(href)

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)


def _read(site: Path, page: str) -> _Page:
    parsed = _Page()
    parsed.feed((site / page).read_text())
    return parsed


def _content_links(site: Path, page: str) -> set[str]:
    """Pages of the site that ``page``'s own content links to (the navigation bar left out: only what the page
    itself says counts as a click a newcomer is shown)."""
    html = (site / page).read_text()
    article = html[html.index("<article"):html.index("</article>")]
    links = set()
    for href in re.findall(r'<a [^>]*href="([^"]+)"', article):
        target, _ = urldefrag(urljoin(page, href))
        if target.endswith(".html") and "://" not in href and (site / target).is_file():
            links.add(target)
    return links


def test_site_builds_offline_with_every_page(site):
    assert (site / "index.html").is_file()
    for page in ("reference/config.html", "concepts/math.html", "reference/python-api.html", "guarantees.html"):
        assert (site / page).is_file(), page
    # MathJax is served by the site itself (no CDN): the script and the fonts it loads are in the build
    assert (site / "javascripts/mathjax/tex-mml-chtml.js").is_file()
    assert list((site / "javascripts/mathjax/output/chtml/fonts/woff-v2").glob("*.woff"))
    math = (site / "concepts/math.html").read_text()
    assert 'class="arithmatex"' in math
    assert not re.search(r'<script[^>]+src="https?://', math), "a page loads a script from the network"


def test_formulas_and_code_render_in_a_real_browser(site):
    """Headless Chromium loads the built pages from the file system: MathJax typesets the math page's formulas
    (no error), and the home page and the config reference show their tables and code blocks."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing, though .ci/run installs it")
        pytest.skip("chromium is not installed here (apt-get install chromium): the rendering check needs it")

    def dom(page: str) -> str:
        proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000",
                               "--dump-dom", (site / page).as_uri()], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    math = dom("concepts/math.html")
    typeset = math.count("<mjx-container")
    assert typeset >= 20, f"MathJax typeset {typeset} formulas on the math page"
    assert "<mjx-merror" not in math, "MathJax could not typeset a formula"
    assert math.count('class="arithmatex"') == typeset  # every formula typeset, none left as TeX source
    home = dom("index.html")
    assert "<table" in home and "make train" in home
    config = dom("reference/config.html")
    assert "<table" in config and "data.max_lag" in config


@pytest.mark.parametrize("question, page_pattern, answer", [
    ("how to write a loss", r"how-to/own-loss\.html", r"PolicyLoss"),
    ("what prompt_mean computes", r"concepts/.*\.html", r"prompt_mean[^.]*mean over (the )?groups"),
    ("what data.max_lag means", r".*\.html", r"data\.max_lag\W+(int\W+)?\d+\W+[^|]*stale"),
    ("what a kill -9 during a save loses", r".*\.html", r"kill -9 during a checkpoint save loses \w+.{0,200}\.tmp"),
])
def test_a_newcomer_finds_it_within_two_clicks_of_the_home_page(site, question, page_pattern, answer):
    reached = {"index.html"}
    for _ in range(2):
        reached |= {target for page in reached for target in _content_links(site, page)}
    found = [page for page in sorted(reached) if re.fullmatch(page_pattern, page)
             and re.search(answer, " ".join(" ".join(_read(site, page).text).split()), re.IGNORECASE)]
    assert found, f"{question}: no page within two clicks of the home page answers it ({answer!r})"


def test_the_readme_is_a_front_page_whose_links_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for line in QUICK_START:
        assert line in readme.splitlines()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"


def test_nothing_refers_to_a_contract_outside_the_repository():
    """The docs are the contract: no tracked file points at the old shared folder or at a SPEC file."""
    outside = "../" + "shared"
    spec = "SPEC" + r"(\.md| §)"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".png", ".parquet") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if outside in text or re.search(spec, text):
            offenders.append(name)
    assert offenders == []
