"""The CLI reference page (docs/reference/cli.md) is generated from `rlcli.cli`: it is current and holds every
command. Fails when a command of `rlcli.cli.COMMANDS` has no section, or when the page depends on the
terminal's width (that the committed page is current is tests/unit/docgen/test_pages.py's)."""

from __future__ import annotations

from rlcli import cli
from tools.docgen import cli as page


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
