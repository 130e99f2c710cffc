"""The metrics reference page (docs/reference/metrics.md) is generated from the ``METRICS`` declarations of the
modules that emit metrics: it is current, every declaration is documented, and no declaring module is left out.

How each test fails when broken (a page not regenerated after a declaration changed fails
tests/unit/docgen/test_pages.py): a declaration with an empty ``when``
or description fails `test_every_declared_metric_is_documented` naming it; a module that declares ``METRICS``
without being listed in ``tools.docgen.metrics.SECTIONS`` (its metrics would be missing from the page) fails
`test_every_declaring_module_is_on_the_page` naming the module. That every column of a real run is declared
is tests/e2e/test_metrics_declared.py's.
"""

from __future__ import annotations

import ast
from pathlib import Path

from rlcli.modules.metrics import Metric
from tools.docgen import metrics as page

ROOT = Path(__file__).resolve().parents[3]

NOT_CSV = {"rlcli.rollout.evaluate"}  # `rlcli eval`'s metrics: metrics.csv has them as eval/<metric>


def test_every_declared_metric_is_documented():
    declared = page.declared()
    assert len(declared) >= 40
    bad = [name for name, metric in declared
           if not (isinstance(metric, Metric) and metric.when.strip() and metric.description.strip())]
    assert bad == []


def test_every_declaring_module_is_on_the_page():
    """Every module of rlcli with a module-level ``METRICS`` dict is a section's (or `rlcli eval`'s)."""
    declaring = set()
    for path in (ROOT / "rlcli").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "METRICS" for t in targets):
                declaring.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    listed = {module for section in page.SECTIONS for module in section.modules}
    assert declaring - NOT_CSV == listed


def test_every_section_is_on_the_page_with_its_metrics():
    text = page.render()
    for section in page.SECTIONS:
        assert f"\n## {section.title}\n" in text
    for name, _ in page.declared():
        assert f"| `{name}` |" in text


def test_a_pattern_name_matches_one_column_per_name():
    assert page.matches("reward/<name>", "reward/math_verify")
    assert not page.matches("reward/<name>", "reward")
    assert not page.matches("reward/<name>", "reward/a/b")
    assert page.matches("eval/pass@k", "eval/pass@k") and not page.matches("eval/pass@k", "eval/pass@1")
