"""User-facing errors: the CLI prints their message and exits with code 2, no traceback."""


class UserError(Exception):
    """A mistake in the user's config, data or model: fix the input, not the code."""
