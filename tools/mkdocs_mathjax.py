"""MkDocs hook: serve MathJax from the installed ``django-static-mathjax`` wheel, so formulas render
without a CDN and the build needs no network.

It adds MathJax's ``tex-mml-chtml.js`` and the web fonts it loads (found relative to the script)
to the site under ``javascripts/mathjax/``, where ``mkdocs.yml``'s ``extra_javascript`` names it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File, Files

SITE_DIR = "javascripts/mathjax"
WANTED = ("tex-mml-chtml.js", "output/chtml/fonts/woff-v2")


def _es5() -> Path:
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("MathJax is missing: pip install -c constraints.txt -e '.[dev]' (django-static-mathjax)")
    return Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "es5"


def on_files(files: Files, config) -> Files:
    es5 = _es5()
    for wanted in WANTED:
        source = es5 / wanted
        for path in sorted([source] if source.is_file() else source.rglob("*")):
            if path.is_file():
                relative = path.relative_to(es5).as_posix()
                files.append(File.generated(config, f"{SITE_DIR}/{relative}", abs_src_path=str(path)))
    return files
