"""The generated pages of the docs (config, metrics and CLI reference) are what the code renders now: a
changed schema field, metric declaration or command without ``python -m tools.docgen`` fails here, naming
the page."""

from __future__ import annotations

from tools.docgen import pages, stale


def test_every_generated_page_is_current():
    assert set(pages()) == {"reference/config.md", "reference/metrics.md", "reference/cli.md"}
    assert stale() == [], "out of date (run `python -m tools.docgen`)"
