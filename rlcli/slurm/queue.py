"""What Slurm says of the members of a job array: ``squeue`` for those still in its queue, ``sacct`` for
how the others ended."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

# the states of a member that is still to end (sacct can lag behind squeue for a moment)
UNFINISHED = frozenset({"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "RESIZING", "SUSPENDED",
                        "PREEMPTED", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED"})


@dataclass(frozen=True)
class MemberState:
    state: str  # Slurm's: PENDING, RUNNING, COMPLETED, CANCELLED (by UID), TIMEOUT, FAILED, NODE_FAIL, ...
    reason: str = "None"  # Slurm's reason for a pending member, e.g. Resources, Priority, PartitionConfig

    @property
    def has_reason(self) -> bool:
        """Whether Slurm gave a reason (it says ``None`` or nothing when it has none)."""
        return self.reason not in ("None", "")


def _slurm(command: list[str]) -> str | None:
    """The output of a Slurm command; None when it fails (the controller busy or restarting)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None


def _job_ids(field: str) -> list[str]:
    """The job ids of an squeue/sacct ``JobID``: ``12``, ``12_3``, or several members at once in Slurm's
    ``12_[0-3,5%2]`` (the ``%`` limit dropped)."""
    array, _, members = field.partition("_[")
    if not members:
        return [field]
    ids = []
    for part in members.rstrip("]").split("%")[0].split(","):
        first, _, last = part.partition("-")
        ids += [f"{array}_{i}" for i in range(int(first), int(last or first) + 1)]
    return ids


def _by_job(output: str, job_ids: list[str], fields: int) -> dict[str, list[str]]:
    """``JOBID|...`` lines by the job ids among ``job_ids`` they are about."""
    rows = {}
    for line in output.splitlines():
        job, *rest = line.strip().split("|")
        if len(rest) == fields:
            rows.update({i: rest for i in _job_ids(job) if i in job_ids})
    return rows


def states(job_ids: list[str]) -> dict[str, MemberState] | None:
    """What Slurm's controller says of ``job_ids`` (the jobs of one submission: ``12``, or ``12_0``, ``12_1``,
    ...), also of those that ended lately; a job it no longer knows is missing. None when squeue cannot
    answer now."""
    output = _slurm(["squeue", "--noheader", "--array", "--states=all", "--jobs", job_ids[0].split("_")[0],
                     "--format", "%i|%T|%r"])
    if output is None:
        return None
    return {i: MemberState(state, reason) for i, (state, reason) in _by_job(output, job_ids, 2).items()}


def accounted(job_ids: list[str], wait_s: float = 10) -> dict[str, MemberState]:
    """How the jobs ``job_ids`` (of one submission) ended, from Slurm's accounting, which may lag a moment
    behind (waiting up to ``wait_s``); a job it has no end for (one cancelled before it started) is
    ``UNKNOWN``."""
    deadline = time.monotonic() + wait_s
    while True:
        output = _slurm(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_ids[0].split("_")[0],
                         "--format", "JobID,State,Reason"])
        rows = _by_job(output or "", job_ids, 2)
        found = {i: MemberState(*rows[i]) if i in rows else MemberState("UNKNOWN") for i in job_ids}
        if not any(unfinished(s) or s.state == "UNKNOWN" for s in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(1)


def unfinished(state: MemberState) -> bool:
    return state.state.split()[0] in UNFINISHED
