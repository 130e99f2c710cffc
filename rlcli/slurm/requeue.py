"""Slurm's time-limit warning in a sweep member: rlcli saves, then submitit requeues.

hydra-submitit-launcher asks Slurm for ``--signal=USR2@<signal_delay_s>``, and Slurm sends SIGUSR2 to every
task of the job. `rlcli.signals` takes it (`TIME_LIMIT`) like SIGTERM (the step in progress finishes and every
rank saves a checkpoint), then `rlcli train` hands the job over to submitit's own handler of the signal
(`requeue`; at start-up through `RunSignals`'s ``at_time_limit``): on rank 0 it requeues the
job, counting the timeouts against ``hydra.launcher.max_num_timeout``, or raises why it will not. That is
the one requeue mechanism of a sweep: Lightning's SLURM auto-requeue is never installed
(`rlcli.callbacks.preemption.StopOnSignal.setup`).
"""

from __future__ import annotations

from rlcli.signals import TIME_LIMIT


def requeue(handler) -> None:
    """Hand this job over to ``handler``, the handler of `TIME_LIMIT` that the run's own signal handling
    replaced: submitit's in a sweep member, which requeues the job and exits the process (or raises
    `submitit.core.utils.UncompletedJobError` saying why it does not). Outside submitit there is nothing
    to hand over to."""
    if callable(handler):
        handler(TIME_LIMIT, None)
