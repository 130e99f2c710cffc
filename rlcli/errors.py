"""User-facing errors: the CLI prints their message and exits with code 2 (`UserError`) or
`CLUSTER_FAILURE` (`ClusterError`), no traceback."""


class UserError(Exception):
    """A mistake in the user's config, data or model: fix the input, not the code."""


CLUSTER_FAILURE = 3  # the exit code of `rlcli train -m launcher=slurm` when Slurm did not run the sweep through


class ClusterError(Exception):
    """Slurm did not run a sweep through: it refused the submission, never started a job, or a job ended
    without its result (cancelled, failed on a node, timed out too often)."""
