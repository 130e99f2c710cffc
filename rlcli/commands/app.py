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
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rlcli.conf import quiet_local_config_folder  # (and the config's resolvers)
from rlcli.errors import CLUSTER_FAILURE, ClusterError, UserError
from rlcli.storage import REFUSED_BY_STORAGE

Task = Callable[[DictConfig, Path], int | None]  # the exit code; None: 0


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
        """Run the app with ``args`` (Hydra's overrides and options) on the command line; the exit code."""
        errors = group_override_errors(args)
        if not errors and ("--help" in args or "-h" in args):
            return self._help([arg for arg in args if arg not in ("--help", "-h")])
        if errors:
            from rlcli.conf.validate import ConfigError

            print(f"rlcli {self.command}: error: {ConfigError(errors)}", file=sys.stderr)
            return 2

        @functools.wraps(self.task)  # Hydra names the job after the task's module: its log is <module>.log
        def job(cfg: DictConfig) -> None:
            self._job(cfg)

        main = hydra.main(config_path="pkg://rlcli.conf", config_name="config", version_base="1.3")(job)
        sys.argv = [sys.argv[0], *args]
        quiet_local_config_folder()
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises what fails before the task, for us to report
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
        try:
            cfg = compose(overrides, with_hydra=True)
        except Exception as err:
            print(f"rlcli {self.command}: error: {_before_task(err)}", file=sys.stderr)
            return 2
        print(help_text(self.command, cfg), end="")
        return 0

    def _job(self, cfg: DictConfig) -> None:
        """One run of the task (each member of a sweep is one), in the run directory Hydra made."""
        from hydra.core.hydra_config import HydraConfig

        self.started = True
        with _exit_on_user_error(self.command):
            code = self.task(cfg, Path(HydraConfig.get().runtime.output_dir))
        if code:
            sys.exit(code)


@contextmanager
def _exit_on_user_error(command: str) -> Iterator[None]:
    """Inside a task: a `UserError`, or a file the storage refused, becomes one line
    ``rlcli <command>: error: ...`` on stderr and exit 2."""
    try:
        yield
    except UserError as err:
        print(f"rlcli {command}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:
        if err.errno not in REFUSED_BY_STORAGE or err.filename is None:
            raise
        print(f"rlcli {command}: error: {err.filename}: {err.strerror}", file=sys.stderr)
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
