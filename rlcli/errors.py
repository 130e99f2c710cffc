"""User-facing errors: the CLI prints their message and exits with code 2, no traceback."""

import sys
from contextlib import contextmanager


class UserError(Exception):
    """A mistake in the user's config, data or model: fix the input, not the code."""


@contextmanager
def exit_on_user_error(command: str):
    """Inside a command: a `UserError` becomes one line ``rlcli <command>: error: ...`` on stderr and exit 2."""
    try:
        yield
    except UserError as err:
        print(f"rlcli {command}: error: {err}", file=sys.stderr)
        sys.exit(2)
