"""The CLI reference page: each command's usage from `rlcli.cli` (its ``--help`` where argparse parses it), and
its exit codes, the numbers taken from the constants the code exits with."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from contextlib import contextmanager

from rlcli import cli
from rlcli.errors import CLUSTER_FAILURE
from rlcli.signals import EXIT_CODES, TIME_LIMIT

COLUMNS = "100"  # argparse wraps its help at the terminal's width: a fixed one, so the page does not depend on it
CONFIG_ERROR = 2  # `UserError`, a config that does not compose, argparse's usage errors
INTERRUPTED = EXIT_CODES[signal.SIGINT]

HYDRA_APPS = ("train", "sample", "loop", "eval")
ARGPARSE = {"data": cli.data_parser, "stream": cli.stream_parser, "report": cli.report_parser}


def _signal_codes() -> dict[int, list[str]]:
    """``{exit code: the signals that give it}`` of a `rlcli train` run a signal stops."""
    codes: dict[int, list[str]] = {}
    for number, code in EXIT_CODES.items():
        codes.setdefault(code, []).append(signal.Signals(number).name)
    return codes


def _train_codes() -> list[tuple[int, str]]:
    stops = {
        "SIGINT": "Ctrl-C", "SIGTERM": "preemption", "SIGUSR1": "Lightning's warning before a Slurm time limit",
        signal.Signals(TIME_LIMIT).name: "the warning before a job's time limit; a Slurm job is then requeued",
    }
    codes = [(0, "the run finished and exported the policy (a process other than rank 0 also exits 0 when a signal "
                 "stops the run)"),
             (CONFIG_ERROR, "a config, data or model error, one line on stderr: the config does not compose or is "
                            "rejected, a record or a model is refused, the run directory cannot be written, or "
                            "training diverged (non-finite weights, `trainer.max_bad_steps` bad steps in a row)"),
             (CLUSTER_FAILURE, "`-m launcher=slurm`: Slurm did not run the sweep through (it refused the submission, "
                               "never started a job, or a job ended without its result)")]
    for code, names in sorted(_signal_codes().items()):
        which = ", ".join(f"{name} ({stops[name]})" for name in names)
        codes.append((code, f"stopped by {which}: the step in progress finished and a checkpoint was saved "
                            "(continue with `resume=auto`); while the run starts, at once with nothing to save"))
    return sorted(codes)


EXIT_CODES_OF: dict[str, Callable[[], list[tuple[int, str]]]] = {
    "train": _train_codes,
    "sample": lambda: [(0, "the trainer announced its final weights, or a SIGTERM ended the sampler after its "
                           "current round"),
                       (CONFIG_ERROR, "a config error (`data.url` is required), one line on stderr"),
                       (INTERRUPTED, "SIGINT (Ctrl-C) ended it after its current round")],
    "loop": lambda: [(CONFIG_ERROR, "a config error, one line on stderr"),
                     (INTERRUPTED, "SIGINT (Ctrl-C) or SIGTERM: every process was stopped with a SIGTERM"),
                     (-1, "otherwise the trainer's exit code (`128 + N` when a signal N killed it)")],
    "eval": lambda: [(0, "`eval.json` written"),
                     (CONFIG_ERROR, "no model directory, or a config or model error, one line on stderr")],
    "data": lambda: [(0, "every record is valid"),
                     (CONFIG_ERROR, "an invalid record, no record at all, a file that cannot be read, or bad "
                                    "arguments")],
    "stream": lambda: [(0, "every record pushed"),
                       (CONFIG_ERROR, "an invalid record (nothing is pushed then), an unreachable server, or bad "
                                      "arguments, one line on stderr")],
    "report": lambda: [(0, "the plots (and the table of a sweep) written"),
                       (CONFIG_ERROR, "PATH is not a run or a sweep, a file cannot be read, or bad arguments, one "
                                      "line on stderr")],
}


@contextmanager
def _fixed_width():
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def _helps(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """``(command line, --help text)`` of ``parser`` and of each of its subcommands."""
    with _fixed_width():
        out = [(parser.prog, parser.format_help())]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += [(sub.prog, sub.format_help()) for sub in action.choices.values()]
    return out


def _code_table(codes: list[tuple[int, str]]) -> str:
    rows = "".join(f"| {'other' if code < 0 else code} | {what} |\n" for code, what in codes)
    return f"| exit code | when |\n|---|---|\n{rows}"


def _usage_of(command: str) -> tuple[str, str]:
    """``(usage, what it does)`` of ``command`` in `rlcli.cli.COMMAND_HELP`."""
    return next((usage, what) for usage, what in cli.COMMAND_HELP if usage.split()[0] == command)


HYDRA_INTRO = """\
`train`, `sample`, `loop` and `eval` are Hydra apps over one config: their arguments are overrides,
`KEY=VALUE` (`trainer.max_steps=100`), `GROUP=OPTION` (`loss=gspo`), `+KEY=VALUE` (a key the config does
not have) and `~GROUP` (leave a group out). The [config reference](./config.md) lists every key. Each also takes:

- `--help` (`-h`): the config groups and every key of the config the other overrides compose, with its
  value, type, limits and description;
- `--cfg job`: print the composed config and exit;
- `--hydra-help`: Hydra's own help.

A config that does not compose or that the checks reject is one line on stderr and exit code 2, before
anything runs.
"""


def render() -> str:
    parts = ["# CLI\n\n`rlcli <command> [args]`; `rlcli --help` prints:\n\n```text\n", cli.USAGE, "```\n\n",
             "`rlcli` alone prints the same and exits 2; so does an unknown command.\n\n",
             "## Hydra apps\n\n", HYDRA_INTRO]
    for command in HYDRA_APPS:
        usage, what = _usage_of(command)
        parts += [f"\n## rlcli {command}\n\n```text\nrlcli {usage}\n```\n\n{what[0].upper()}{what[1:]}.\n\n",
                  _code_table(EXIT_CODES_OF[command]())]
    for command, build in ARGPARSE.items():
        parts.append(f"\n## rlcli {command}\n\n")
        for prog, text in _helps(build()):
            heading = "" if prog == f"rlcli {command}" else f"### {prog}\n\n"
            parts.append(f"{heading}```text\n$ {prog} --help\n{text}```\n\n")
        parts.append(_code_table(EXIT_CODES_OF[command]()))
    return "".join(parts)
