"""The CLI reference page (docs/reference/cli.md) is generated from `rlcli.cli`: it is current and holds every
command. Fails when a parser, a command's help or an exit code constant changed and the page was not
regenerated (run ``python -m tools.docgen``), or when a command of `rlcli.cli.COMMANDS` has no section."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tools/ is not installed

from rlcli import cli  # noqa: E402
from tools.docgen import DOCS, HEADER  # noqa: E402
from tools.docgen import cli as page  # noqa: E402


def test_the_committed_page_is_current():
    committed = (DOCS / "reference" / "cli.md").read_text()
    assert committed == HEADER + page.render(), "docs/reference/cli.md is out of date: run python -m tools.docgen"


def test_every_command_has_a_section_and_its_exit_codes():
    text = page.render()
    assert set(cli.COMMANDS) == set(page.HYDRA_APPS) | set(page.ARGPARSE) == set(page.EXIT_CODES_OF)
    for command in cli.COMMANDS:
        assert f"\n## rlcli {command}\n" in text


def test_the_page_does_not_depend_on_the_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = page.render()
    monkeypatch.setenv("COLUMNS", "300")
    assert page.render() == narrow


def test_the_usage_of_rlcli_help_is_built_from_the_command_table(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out == cli.USAGE
    assert all(usage in out and what in out for usage, what in cli.COMMAND_HELP)
