"""Slurm's queue and accounting as `rlcli.slurm.queue` reads them, from recorded ``squeue`` and ``sacct``
output (written in the formats the module asks for), so these tests need no cluster."""

from __future__ import annotations

import pytest

from rlcli.slurm import queue
from rlcli.slurm.queue import MemberState, accounted, states, unfinished

# `squeue --noheader --array --states=all --jobs 4127 --format %i|%T|%r` while a 6-member array runs: two
# members running, one waiting for resources, two still pending as one range (the array's % limit), one
# that ended lately, and a line of another job of the same user that squeue printed too
SQUEUE = """\
4127_0|RUNNING|None
4127_1|RUNNING|None
4127_2|PENDING|Resources
4127_[3-4%2]|PENDING|JobArrayTaskLimit
4127_5|COMPLETED|None
4130|RUNNING|None
"""

# `sacct --noheader --parsable2 --allocations --jobs 4127 --format JobID,State,Reason` after the array ended:
# member 4 never started (cancelled while pending: no record of its own), member 5 is still being accounted
SACCT_LAGGING = """\
4127_0|COMPLETED|None
4127_1|CANCELLED by 1000|None
4127_2|TIMEOUT|None
4127_3|NODE_FAIL|None
4127_5|RUNNING|None
"""
SACCT = SACCT_LAGGING.replace("4127_5|RUNNING|None", "4127_5|FAILED|NonZeroExitCode")
# the same once the cancelled member's record came in too
SACCT_COMPLETE = SACCT + "4127_4|CANCELLED by 1000|None\n"
MEMBERS = [f"4127_{i}" for i in range(6)]


class Recorded:
    """Stands for `rlcli.slurm.queue._slurm`: answers each call with the next recorded output (None: the
    command failed; the last one again once they are used up) and keeps the command lines it was asked to run."""

    def __init__(self, *outputs: str | None) -> None:
        self.outputs, self.commands = list(outputs), []

    def __call__(self, command: list[str]) -> str | None:
        self.commands.append(command)
        return self.outputs.pop(0) if len(self.outputs) > 1 else self.outputs[0]


@pytest.fixture
def slurm(monkeypatch):
    """Install recorded outputs: ``slurm(out1, out2, ...)`` returns the `Recorded` stand-in."""

    def install(*outputs: str | None) -> Recorded:
        recorded = Recorded(*outputs)
        monkeypatch.setattr(queue, "_slurm", recorded)
        monkeypatch.setattr(queue.time, "sleep", lambda seconds: None)
        return recorded

    return install


def test_squeue_output_gives_each_member_its_state_and_reason(slurm):
    recorded = slurm(SQUEUE)
    found = states(MEMBERS)
    assert found == {
        "4127_0": MemberState("RUNNING"), "4127_1": MemberState("RUNNING"),
        "4127_2": MemberState("PENDING", "Resources"),
        "4127_3": MemberState("PENDING", "JobArrayTaskLimit"), "4127_4": MemberState("PENDING", "JobArrayTaskLimit"),
        "4127_5": MemberState("COMPLETED"),
    }
    assert recorded.commands == [["squeue", "--noheader", "--array", "--states=all", "--jobs", "4127",
                                  "--format", "%i|%T|%r"]]


def test_a_member_squeue_no_longer_shows_is_missing_and_other_jobs_are_left_out(slurm):
    slurm("4127_1|COMPLETING|None\n4130|RUNNING|None\n  \nslurm_load_jobs error: Socket timed out\n")
    assert states(["4127_0", "4127_1"]) == {"4127_1": MemberState("COMPLETING")}


def test_a_single_job_is_its_own_id(slurm):
    slurm("88|PENDING|Priority\n")
    assert states(["88"]) == {"88": MemberState("PENDING", "Priority")}


def test_squeue_that_cannot_answer_is_none(slurm):
    slurm(None)
    assert states(MEMBERS) is None


def test_sacct_output_says_how_each_member_ended(slurm):
    recorded = slurm(SACCT)
    assert accounted(MEMBERS, wait_s=0) == {
        "4127_0": MemberState("COMPLETED"), "4127_1": MemberState("CANCELLED by 1000"),
        "4127_2": MemberState("TIMEOUT"), "4127_3": MemberState("NODE_FAIL"),
        "4127_4": MemberState("UNKNOWN"), "4127_5": MemberState("FAILED", "NonZeroExitCode"),
    }
    assert recorded.commands[0] == ["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", "4127",
                                    "--format", "JobID,State,Reason"]


def test_accounting_that_lags_behind_is_asked_again_until_every_member_has_ended(slurm):
    recorded = slurm(SACCT_LAGGING, None, SACCT_COMPLETE)
    found = accounted(MEMBERS, wait_s=60)
    assert len(recorded.commands) == 3  # a member still running, then sacct failing, then all ended
    assert found["4127_5"] == MemberState("FAILED", "NonZeroExitCode")
    assert found["4127_4"] == MemberState("CANCELLED by 1000")


def test_accounting_gives_up_waiting_after_wait_s(slurm, monkeypatch):
    slurm(SACCT_LAGGING)
    clock = iter(range(0, 1000, 5))
    monkeypatch.setattr(queue.time, "monotonic", lambda: next(clock))
    found = accounted(MEMBERS, wait_s=10)
    assert found["4127_5"] == MemberState("RUNNING") and found["4127_4"] == MemberState("UNKNOWN")


@pytest.mark.parametrize("field, ids", [
    ("12", ["12"]),
    ("12_3", ["12_3"]),
    ("12_[7]", ["12_7"]),
    ("12_[0-2,5]", ["12_0", "12_1", "12_2", "12_5"]),
    ("12_[3-4%2]", ["12_3", "12_4"]),
])
def test_job_ids_of_one_squeue_or_sacct_field(field, ids):
    assert queue._job_ids(field) == ids


@pytest.mark.parametrize("state, still_to_end", [
    ("PENDING", True), ("RUNNING", True), ("REQUEUED", True), ("COMPLETING", True), ("PREEMPTED", True),
    ("COMPLETED", False), ("CANCELLED by 1000", False), ("TIMEOUT", False), ("FAILED", False),
    ("NODE_FAIL", False), ("OUT_OF_MEMORY", False), ("UNKNOWN", False),
])
def test_which_states_are_still_to_end(state, still_to_end):
    assert unfinished(MemberState(state)) is still_to_end


@pytest.mark.parametrize("reason, given", [("Resources", True), ("None", False), ("", False)])
def test_a_reason_is_given_unless_slurm_says_none(reason, given):
    assert MemberState("PENDING", reason).has_reason is given


def test_a_slurm_command_gives_its_output_or_none_when_it_fails():
    assert queue._slurm(["false"]) is None
    assert queue._slurm(["sh", "-c", "echo '4127_0|RUNNING|None'"]) == "4127_0|RUNNING|None\n"
