"""The time-limit signal during start-up: `RunSignals` hands the job over through ``at_time_limit`` (what
`rlcli train` gives it: `rlcli.slurm.requeue.requeue`) before the process exits with the signal's code."""

from __future__ import annotations

import subprocess
import sys

from rlcli.signals import EXIT_CODES, TIME_LIMIT

# a process whose TIME_LIMIT handler before the run's stands for submitit's (it writes where it was called)
SCRIPT = """
import os, signal, sys, time
from rlcli.signals import TIME_LIMIT, RunSignals
from rlcli.slurm.requeue import requeue

def submitit_handler(signum, frame):
    print("requeued with", signal.Signals(signum).name, flush=True)

signal.signal(TIME_LIMIT, submitit_handler)
with RunSignals(at_time_limit=requeue):
    os.kill(os.getpid(), TIME_LIMIT)
    time.sleep(30)  # start-up: the signal ends the process from the signals' thread
print("not reached", flush=True)
"""


def test_the_time_limit_during_start_up_hands_the_job_over_then_exits_with_its_code():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_CODES[TIME_LIMIT] == 140, result.stderr
    assert result.stdout == f"requeued with {TIME_LIMIT.name}\n"
    assert f"{TIME_LIMIT.name} during start-up: nothing to save yet" in result.stderr


def test_signals_do_not_import_slurm():
    code = "import sys, rlcli.signals; print('rlcli.slurm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout == "False\n"
