"""The one wrapper of rlcli's Hydra apps: a command's task ``task(cfg, run_dir) -> exit code or None``
becomes a Hydra app over the package's config, run with the user's overrides as arguments.

    @hydra_app("sample")
    def app(cfg: DictConfig, run_dir: Path) -> int: ...

    rlcli.commands.sample.app.run(["data.url=redis://..."])  # the exit code

``--help`` (``-h``) prints the config groups and every key of the config the other arguments compose,
each with its description (`rlcli.conf.describe`); ``--hydra-help`` is Hydra's own help.

The exit code tells the config from the run: 2 for a config that does not compose or is rejected (the
task's `UserError`), for a run directory that cannot be made and for a file the storage refuses;
`CLUSTER_FAILURE` when Slurm did not run a sweep through; otherwise the task's own code.

A task may return a `Score` (exit code 0): the value Hydra's optimising sweepers (``hydra/sweeper=optuna``)
optimise. Under such a sweeper a member that fails raises `MemberFailed` instead of exiting: the sweeper
records a failed trial and goes on within its failure budget (``hydra.sweeper.max_failure_rate``). Hydra's
basic sweeper and a single run keep the exit codes.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rlcli.conf import quiet_local_config_folder  # (and the config's resolvers)
from rlcli.conf.sweepers import register_sweepers
from rlcli.errors import CLUSTER_FAILURE, ClusterError, UserError
from rlcli.redis_password import hide_password
from rlcli.storage import REFUSED_BY_STORAGE

log = logging.getLogger("rlcli")
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"  # Hydra's default: a grid, no values
_PACKAGE_DIR = str(Path(__file__).parent.parent) + os.sep  # rlcli's own files, as its warnings name them


@dataclass(frozen=True)
class Score:
    """A task's end with exit code 0 and a value for Hydra's optimising sweepers (`rlcli train`'s
    objective), or None with the reason it has none."""

    value: float | None
    failed: str | None = None


Task = Callable[[DictConfig, Path], int | Score | None]  # the exit code (None: 0), or a Score


class MemberFailed(Exception):
    """A member of an optimising sweep that failed, in one line naming its run directory and why."""


def hydra_app(command: str) -> Callable[[Task], HydraApp]:
    """Decorator: ``task`` as the Hydra app of ``rlcli <command>``."""

    def wrap(task: Task) -> HydraApp:
        return HydraApp(command, task)

    return wrap


class HydraApp:
    """The Hydra app of ``rlcli <command>`` around ``task``; ``started`` says whether the task began (what
    fails before it is Hydra's composition of the config, or the run directory Hydra makes)."""

    def __init__(self, command: str, task: Task) -> None:
        self.command, self.task = command, task
        self.started = False

    def run(self, args: list[str]) -> int:
        """Run the app with ``args`` (Hydra's overrides and options) on the command line; the exit code.
        A Redis password in ``data.url`` goes to the environment first: nothing the run writes holds it."""
        try:
            args = hide_password(args)
        except UserError as err:
            print(f"rlcli {self.command}: error: {err}", file=sys.stderr)
            return 2
        errors = group_override_errors(args)
        if not errors and ("--help" in args or "-h" in args):
            return self._help([arg for arg in args if arg not in ("--help", "-h")])
        if errors:
            from rlcli.conf.validate import ConfigError

            print(f"rlcli {self.command}: error: {ConfigError(errors)}", file=sys.stderr)
            return 2

        @functools.wraps(self.task)  # Hydra names the job after the task's module: its log is <module>.log
        def job(cfg: DictConfig) -> float | None:
            return self._job(cfg)

        main = hydra.main(config_path="pkg://rlcli.conf", config_name="config", version_base="1.3")(job)
        sys.argv = [sys.argv[0], *args]
        quiet_local_config_folder()
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises what fails before the task, for us to report
        register_sweepers()
        self.started = False
        try:
            main()
        except SystemExit as exit:
            if exit.code == 1 and not self.started:  # Hydra's exit on a config that does not compose
                return 2
            return exit.code if isinstance(exit.code, int) else 1
        except ClusterError as err:  # the driver of a Slurm sweep
            print(f"rlcli {self.command}: error: {err}", file=sys.stderr)
            return CLUSTER_FAILURE
        except MemberFailed as err:  # an optimising sweeper's failure budget is spent: it raises a failure
            print(f"rlcli {self.command}: error: the sweep stopped, more members failed than "
                  f"hydra.sweeper.max_failure_rate allows; {err}", file=sys.stderr)
            return 2
        except Exception as err:
            if self.started:
                raise
            print(f"rlcli {self.command}: error: {_before_task(err)}", file=sys.stderr)
            return 2
        return 0

    def _help(self, args: list[str]) -> int:
        """Print the groups and the described keys of the config that ``args``' overrides compose."""
        from rlcli.conf.describe import compose, help_text

        overrides = [arg for arg in args if not arg.startswith("-")]
        register_sweepers()
        try:
            cfg = compose(overrides, with_hydra=True)
        except Exception as err:
            print(f"rlcli {self.command}: error: {_before_task(err)}", file=sys.stderr)
            return 2
        print(help_text(self.command, cfg), end="")
        return 0

    def _job(self, cfg: DictConfig) -> float | None:
        """One run of the task (each member of a sweep is one), in the run directory Hydra made, recorded in
        its ``manifest.json`` from start to end; its `Score`'s value, for the sweeper."""
        from hydra.core.hydra_config import HydraConfig

        from rlcli.manifest import finish_manifest

        self.started = True
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        status = "failed"
        _own_lines_on_the_console()
        try:
            value = self._member(cfg, run_dir) if _optimising(HydraConfig.get()) else self._run(cfg, run_dir)
            status = "done"
            return value
        except SystemExit as exit:  # a user error's exit carries the error as its context
            reason = user_error(exit.__context__) if isinstance(exit.__context__, Exception) else None
            status = f"failed: {one_line(reason)}" if reason else f"exited with code {exit.code}"
            raise
        except Exception as err:
            status = f"failed: {one_line(user_error(err) or f'{type(err).__name__}: {err}')}"
            raise
        finally:
            logging.captureWarnings(False)
            finish_manifest(run_dir, status)

    def _run(self, cfg: DictConfig, run_dir: Path) -> float | None:
        """A single run, or a member of Hydra's basic sweep: its exit code is the process's."""
        with _exit_on_user_error(self.command):
            result = self._task(cfg, run_dir)
        if isinstance(result, Score):
            return result.value
        if result:
            sys.exit(result)
        return None

    def _task(self, cfg: DictConfig, run_dir: Path) -> int | Score | None:
        """The command's task, after its start is recorded in ``run_dir/manifest.json``."""
        from hydra.core.hydra_config import HydraConfig

        from rlcli.manifest import write_manifest

        write_manifest(run_dir, self.command, list(HydraConfig.get().overrides.task))
        return self.task(cfg, run_dir)

    def _member(self, cfg: DictConfig, run_dir: Path) -> float:
        """A member of an optimising sweep: its value, or `MemberFailed` saying why it has none. An error
        that is no user's (a bug) goes to the sweeper as it is, its traceback in the member's log."""
        try:
            result = self._task(cfg, run_dir)
        except Exception as err:
            reason = user_error(err)
            if reason is None:
                log.exception("rlcli %s failed", self.command)
                raise
            raise MemberFailed(f"{run_dir}: {one_line(reason)}") from None
        if not isinstance(result, Score):
            raise MemberFailed(f"{run_dir}: exit code {result}" if result else
                               f"{run_dir}: rlcli {self.command} gives no value to optimise")
        if result.value is None:
            raise MemberFailed(f"{run_dir}: {result.failed}")
        return result.value


def _own_lines(record: logging.LogRecord) -> bool:
    """The console's filter: rlcli's lines (and Hydra's, a sweep's), the warnings raised in rlcli's code (a
    captured warning's text starts with the file that raised it), and anyone's errors."""
    if record.name == "py.warnings":
        return record.getMessage().startswith(_PACKAGE_DIR)
    return record.name.split(".", 1)[0] in ("rlcli", "hydra") or record.levelno >= logging.ERROR


def _own_lines_on_the_console() -> None:
    """The job's console shows `_own_lines`; the other libraries' lines and Python warnings (transformers'
    deprecations, Lightning's tips and hints) go to the run's log file only (Hydra's file handler), and
    transformers draws no progress bars."""
    from transformers.utils import logging as transformers_logging

    logging.captureWarnings(True)  # warnings.warn: to the logger py.warnings, not to stderr
    transformers_logging.disable_default_handler()  # transformers' own stderr handler: its lines go to the root's
    transformers_logging.enable_propagation()
    transformers_logging.disable_progress_bar()  # "Loading weights" of every model a run loads
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler) and _own_lines not in handler.filters:
            handler.addFilter(_own_lines)


def _optimising(hydra_cfg: DictConfig) -> bool:
    """Whether the job is a member of a sweep whose sweeper optimises its value (Optuna, Ax, Nevergrad:
    every sweeper but Hydra's basic one)."""
    from hydra.types import RunMode

    return hydra_cfg.mode == RunMode.MULTIRUN and hydra_cfg.sweeper._target_ != BASIC_SWEEPER


def user_error(err: Exception) -> str | None:
    """The message of an error that is the user's to fix: a `UserError`, or a file the storage refused
    (``FILE: what the system said``); None for any other error."""
    if isinstance(err, UserError):
        return str(err)
    if isinstance(err, OSError) and err.errno in REFUSED_BY_STORAGE and err.filename is not None:
        return f"{err.filename}: {err.strerror}"
    return None


def one_line(message: str) -> str:
    """A message of several lines (a config's problems) as one."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


@contextmanager
def _exit_on_user_error(command: str) -> Iterator[None]:
    """Inside a task: a `UserError`, or a file the storage refused, becomes one line
    ``rlcli <command>: error: ...`` on stderr and exit 2."""
    try:
        yield
    except Exception as err:
        message = user_error(err)
        if message is None:
            raise
        print(f"rlcli {command}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _before_task(err: Exception) -> str:
    """What went wrong before the task ran: a config that does not compose, or a run directory that
    cannot be created or written (Hydra makes it and its log file first)."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror}"
    cause = err.__cause__
    return f"{err}\n{cause}" if cause is not None and str(cause) not in str(err) else str(err)


def group_override_errors(args: list[str]) -> list[str]:
    """What is wrong with each override that sets a config group to something other than an option name
    or a list of them (``task=null``, ``loss=1``): Hydra fails on those with a traceback."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from rlcli.conf import group_options

    groups = group_options()
    parser, errors = OverridesParser.create(), []
    for arg in args:
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue  # not an override, or one Hydra reports in one line
        group = override.key_or_group
        if group not in groups or override.is_delete() or override.is_sweep_override():
            continue
        value = override.value()
        if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)):
            errors.append(f"{arg}: the config group {group} takes one of {', '.join(groups[group])} (or a list of "
                          f"them); ~{group} leaves it out")
    return errors
