"""User-facing errors: the CLI prints their message and exits with code 2, no traceback."""

import errno
import sys
from contextlib import contextmanager

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # the file does not fit
# a file the system would not let the run write or read: full, over quota, read-only, not permitted
REFUSED_BY_STORAGE = DISK_FULL | {errno.EROFS, errno.EACCES, errno.EPERM}


class UserError(Exception):
    """A mistake in the user's config, data or model: fix the input, not the code."""


CLUSTER_FAILURE = 3  # the exit code of `rlcli train -m launcher=slurm` when Slurm did not run the sweep through


class ClusterError(Exception):
    """Slurm did not run a sweep through: it refused the submission, never started a job, or a job ended
    without its result (cancelled, failed on a node, timed out too often)."""


@contextmanager
def exit_on_user_error(command: str):
    """Inside a command: a `UserError`, or a file the storage refused, becomes one line
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
