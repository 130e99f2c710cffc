"""`rlcli <command>`: a thin dispatcher; each command imports what it needs only when run."""

from __future__ import annotations

import argparse
import os
import signal
import sys

# (usage, what it does) of each command, for `rlcli --help` and the docs' CLI reference
COMMAND_HELP = (
    ("train [HYDRA OVERRIDES]", "train a policy (Hydra app: `rlcli train --help`, `--cfg job`, `-m` sweeps)"),
    ("sample [HYDRA OVERRIDES]", "a sampler of the live loop: pushes rollouts into the stream at data.url"),
    ("loop [HYDRA OVERRIDES]", "the live loop on this machine: Redis, sample.workers samplers and the trainer"),
    ("eval MODEL_DIR [HYDRA OVERRIDES]",
     "evaluate a model directory on the task: reward, pass@1, pass@k (eval.samples)"),
    ("data check FILE...", "validate rollout files and print a summary"),
    ("stream push FILE... --url URL", "push rollout files into a Redis stream (`rlcli train data=stream` reads it)"),
    ("report PATH [--out DIR]", "plots of a run; a sweep's members and seed groups compared, with report.html"),
)
USAGE = "usage: rlcli <command> [args]\n\ncommands:\n" + "".join(
    f"  {usage:<24}  {what}\n" if len(usage) <= 24 else f"  {usage}\n{'':28}{what}\n" for usage, what in COMMAND_HELP
)


def _hydra_app(name: str, args: list[str]) -> int:
    """Run the Hydra app of `rlcli.commands.<name>` (a `rlcli.commands.app.HydraApp`) with ``args`` as its overrides."""
    import importlib

    return importlib.import_module(f"rlcli.commands.{name}").app.run(args)


def _train(args: list[str], *, relaunched: bool = False) -> int:
    """`rlcli train`. Lightning starts the other local processes of a multi-process run by re-running this
    program with the overrides alone (``relaunched``); `LAUNCHER_PID` tells them so, and they die with rank 0."""
    from rlcli.processes import LAUNCHER_PID, die_with_parent, launcher
    from rlcli.signals import hold

    hold()  # the run's signals wait for `rlcli.signals.RunSignals`
    if relaunched:
        die_with_parent(signal.SIGKILL)
        if launcher() is None:
            return 1  # rank 0 ended before this process started
    else:
        os.environ[LAUNCHER_PID] = str(os.getpid())
    return _hydra_app("train", args)


def _sample(args: list[str]) -> int:
    from rlcli.commands.sample import with_stream_data

    return _hydra_app("sample", with_stream_data(args))


def _loop(args: list[str]) -> int:
    from rlcli.commands.sample import with_stream_data

    return _hydra_app("loop", with_stream_data(args))


def _eval(args: list[str]) -> int:
    from rlcli.commands.eval import model_overrides
    from rlcli.errors import UserError

    try:
        overrides = model_overrides(args)
    except UserError as err:
        print(f"rlcli eval: error: {err}", file=sys.stderr)
        return 2
    return _hydra_app("eval", overrides)


def data_parser() -> argparse.ArgumentParser:
    """The parser of `rlcli data`."""
    parser = argparse.ArgumentParser(prog="rlcli data", description="Rollout file tools.")
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="check rollout files against the record rules and print a summary")
    check.add_argument("files", nargs="+", help=".jsonl or .parquet files or globs")
    check.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= this")
    check.add_argument("--max-tokens", type=int, default=None, help="reject longer documents")
    return parser


def _data(args: list[str]) -> int:
    options = data_parser().parse_args(args)

    from rich.console import Console

    from rlcli.data.summary import data_check

    return data_check(options.files, vocab_size=options.vocab_size, max_tokens=options.max_tokens, console=Console())


def stream_parser() -> argparse.ArgumentParser:
    """The parser of `rlcli stream`."""
    from rlcli.rollout.advantages import ADVANTAGE_ESTIMATORS
    from rlcli.stream.push import train_advantage
    from rlcli.stream.records import DEFAULT_STREAM

    advantage = train_advantage()
    parser = argparse.ArgumentParser(prog="rlcli stream", description="The live loop's Redis stream.")
    sub = parser.add_subparsers(dest="action", required=True)
    push = sub.add_parser("push", help="push rollout files into a Redis stream (`rlcli train data=stream` reads it)")
    push.add_argument("files", nargs="+", help=".jsonl or .parquet files or globs")
    push.add_argument("--url", required=True, help="the Redis server: redis://host:port/db")
    push.add_argument("--stream", default=DEFAULT_STREAM, metavar="KEY", help=f"the stream (default {DEFAULT_STREAM})")
    push.add_argument("--advantage", choices=ADVANTAGE_ESTIMATORS.names(), default=advantage.estimator,
                      help="fill missing advantages from rewards per group (default: rlcli train's "
                      f"advantage.estimator, {advantage.estimator}); none: they are an error")
    push.add_argument("--eps", type=float, default=advantage.eps,
                      help="the eps of grpo's (r - mean) / (std + eps) (default: rlcli train's advantage.eps, "
                      f"{advantage.eps})")
    push.add_argument("--k", type=int, default=advantage.k,
                      help=f"--advantage passk: the k of pass@k (default: rlcli train's advantage.k, {advantage.k})")
    return parser


def _stream(args: list[str]) -> int:
    options = stream_parser().parse_args(args)

    from rlcli.errors import UserError
    from rlcli.stream.push import push_files

    try:
        push_files(options.files, options.url, options.stream, options.advantage, options.eps, out=sys.stdout,
                   k=options.k)
    except UserError as err:
        print(f"rlcli stream push: error: {err}", file=sys.stderr)
        return 2
    return 0


def report_parser() -> argparse.ArgumentParser:
    """The parser of `rlcli report`."""
    parser = argparse.ArgumentParser(
        prog="rlcli report",
        description="Plot a run's metrics; for a multirun, compare its members and their configurations over seeds "
        "(mean and 95% interval, report.html)."
    )
    parser.add_argument("path", help="a run directory (with metrics.csv) or a multirun directory (rlcli train -m)")
    parser.add_argument("--out", default=None, metavar="DIR", help="write the files into DIR instead of PATH")
    return parser


def _report(args: list[str]) -> int:
    options = report_parser().parse_args(args)

    from rich.console import Console

    from rlcli.report.command import report_command

    return report_command(options.path, options.out, console=Console())


COMMANDS = {"train": _train, "sample": _sample, "loop": _loop, "eval": _eval, "data": _data, "stream": _stream,
            "report": _report}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    from rlcli.processes import LAUNCHER_PID

    if LAUNCHER_PID in os.environ and "LOCAL_RANK" in os.environ and command not in COMMANDS:
        return _train(argv, relaunched=True)  # a process Lightning started
    if command in COMMANDS:
        return COMMANDS[command](rest)
    print(f"rlcli: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


def run() -> None:
    """Console-script entry point. What rlcli and the processes it starts create is their user's alone
    (umask 077: files 0600, directories 0700), whatever it holds: checkpoints, weights, logs, Redis's data."""
    os.umask(os.umask(0o077) | 0o077)
    sys.exit(main())
