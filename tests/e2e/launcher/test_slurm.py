"""Sweeps on a real one-node Slurm cluster (`scripts/slurm-cluster.sh`): submission with the defaults, the
time-limit signal and `scontrol requeue` mid-run on 1 and 2 processes, and every way a sweep can fail on
the cluster side. Where no cluster answers these tests are skipped, except in CI, which starts one.

The scenarios that run jobs (`SCENARIOS`) run at once, each as its own sweep in a thread: the node's 2 CPUs
run whichever jobs fit while the others wait for CPUs, out a requeue's hold (AuthInfo=cred_expire, 10 s) or
for their driver's next look at the queue (every 5 s): time that the tests one after the other spent idle."""

from __future__ import annotations

import csv
import getpass
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
from fault_injection import FAULTS_ENV, callbacks_override

from rlcli.errors import CLUSTER_FAILURE

pytestmark = pytest.mark.slow
SWEEP = ["train", "-m", "launcher=slurm", "hydra.launcher.partition=debug", "trainer.accelerator=cpu",
         "hydra.launcher.timeout_min=10"]
# the default run on the default rollout files, many steps available
SHORT = ["data=rollouts", "data.epochs=50", "trainer.accumulate_microbatches=1"]
TWO_PROCESSES = ["trainer.devices=2", "strategy=ddp"]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """The cluster must answer; CI starts it (`make slurm-cluster`) before the tests."""
    if shutil.which("scontrol") is None or subprocess.run(["scontrol", "ping"], capture_output=True).returncode:
        if os.environ.get("CI"):
            pytest.fail("no Slurm cluster answers, though CI starts one with `make slurm-cluster`")
        pytest.skip("no Slurm cluster here: `make slurm-cluster` starts one (root, Debian)")


@pytest.fixture(autouse=True)
def no_jobs_left():
    """A test that fails leaves no job behind to hold the node's CPUs."""
    yield
    subprocess.run(["scancel", "--user", getpass.getuser()], capture_output=True)


class Sweep:
    """``rlcli train -m launcher=slurm ...`` in ``cwd``, its output in a file."""

    def __init__(self, cwd: Path, args: list[str]) -> None:
        self.cwd, self.output = cwd, cwd / "driver.txt"
        env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **FAULTS_ENV)
        with self.output.open("w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "rlcli", *SWEEP, *args], cwd=cwd, env=env,
                                            stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.output.read_text()

    def wait_until(self, condition, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.1)

    def finish(self, timeout: float = 600) -> str:
        try:
            self.process.wait(timeout=timeout)
        finally:
            self.process.kill()
        return self.text()

    def job(self, member: int = 0) -> str:
        """The Slurm job id of a member (``JOB`` alone, ``ARRAY_INDEX`` in a sweep of several), once the driver
        has named it."""
        named = re.compile(rf"member #{member} \(Slurm job (\d+(?:_\d+)?)\)")
        self.wait_until(lambda: named.search(self.text()))
        return named.search(self.text()).group(1)

    def members(self) -> list[Path]:
        return sorted(self.cwd.glob("multirun/*/*/[0-9]"))

    def __enter__(self) -> Sweep:
        return self

    def __exit__(self, failed, *_) -> None:
        """A scenario that fails cancels the jobs its driver has named, so that they leave the node's CPUs to
        the scenarios running beside it."""
        jobs = set(re.findall(r"\(Slurm job (\d+)", self.text()))
        if failed:
            self.process.kill()
            if jobs:
                subprocess.run(["scancel", *jobs], capture_output=True)


def steps(run_dir: Path) -> list[int]:
    with (run_dir / "metrics.csv").open() as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def has_steps(sweep: Sweep, count: int):
    def done() -> bool:
        members = sweep.members()
        return bool(members) and (members[0] / "metrics.csv").is_file() and len(steps(members[0])) >= count
    return done


def a_cpu_sweep_with_the_defaults(root: Path) -> None:
    with Sweep(root, ["loss=grpo,gspo", "trainer.max_steps=2", *SHORT]) as sweep:
        output = sweep.finish()
    assert sweep.process.returncode == 0, output[-3000:]
    members = sweep.members()
    assert [m.name for m in members] == ["0", "1"] and all(steps(m) == [1, 2] for m in members)
    [script] = root.glob("multirun/*/*/.submitit/*/*_submission.sh")
    text = script.read_text()
    assert "--gpus-per-node" not in text and "gres" not in text
    for line in ("#SBATCH --cpus-per-task=1", "#SBATCH --mem=8GB", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --signal=USR2@120", "#SBATCH --partition=debug"):
        assert line in text, (line, text)
    for log in root.glob("multirun/*/*/.submitit/*/*_log.err"):
        assert "rlcli_local is not available" not in log.read_text()
    assert re.search(r"member #1 \(Slurm job \d+_1\): RUNNING", output)
    assert re.search(r"member #1 \(Slurm job \d+_1\): COMPLETED", output)


def a_time_limit_and_a_requeue(root: Path, processes: int) -> None:
    """The time-limit signal (SIGUSR2, as Slurm sends it to every task) in the pause after step 2, and
    `scontrol requeue` (SIGTERM) in the pause after step 5 of the requeued job: each stops the run after
    the next step with a checkpoint, and the job comes back and continues from it. (Slurm holds a requeued
    job back for about AuthInfo=cred_expire seconds, 10 on the test cluster, so that the end of its old
    attempt cannot be taken for the end of the new one: the test does not cut that short.)"""
    limit, requeue = root / "limit.go", root / "requeue.go"
    waits = callbacks_override("WaitForFile", steps=[2, 5], paths=[str(limit), str(requeue)])
    with Sweep(root, ["trainer.max_steps=8", *SHORT, *waits,
                      *(TWO_PROCESSES + ["hydra.launcher.cpus_per_task=1"] if processes == 2 else [])]) as sweep:
        job = sweep.job()
        sweep.wait_until(has_steps(sweep, 2))
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        time.sleep(1)
        limit.touch()
        sweep.wait_until(has_steps(sweep, 5))
        subprocess.run(["scontrol", "requeue", job], check=True)
        time.sleep(1)
        requeue.touch()
        output = sweep.finish()
    assert sweep.process.returncode == 0, output[-3000:]
    [member] = sweep.members()
    assert steps(member) == list(range(1, 9))  # every step once, none lost, none repeated
    log = "".join(p.read_text() for p in sorted(root.glob("multirun/*/*/.submitit/*/*_0_log.*")))
    assert "stopped by a signal after step 3; checkpoint saved" in log
    assert "stopped by a signal after step 6; checkpoint saved" in log
    assert re.search(r"resuming from \S+step-3\.ckpt", log) and re.search(r"resuming from \S+step-6\.ckpt", log)
    assert "Traceback" not in log


def too_many_time_limits_end_the_sweep_with_one_message(root: Path) -> None:
    go = root / "go"
    waits = callbacks_override("WaitForFile", steps=[1], paths=[str(go)])
    with Sweep(root, ["trainer.max_steps=8", *SHORT, *waits, "hydra.launcher.max_num_timeout=0"]) as sweep:
        job = sweep.job()
        sweep.wait_until(has_steps(sweep, 1))
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        time.sleep(1)
        go.touch()
        output = sweep.finish()
    assert sweep.process.returncode == CLUSTER_FAILURE, output[-3000:]
    assert re.search(rf"rlcli train: error: member #0 \(Slurm job {job}; its log: \S+_log\.err\) was not requeued: "
                     r"Job not requeued because: timed-out too many times\.", output), output[-2000:]
    assert "Traceback" not in output
    [member] = sweep.members()
    assert (member / "checkpoints" / "step-2.ckpt").is_file()  # kept for a rerun


def a_cancelled_member_and_a_member_with_a_bad_config_are_reported_apart(root: Path) -> None:
    with Sweep(root, ["trainer.max_steps=1000", *SHORT[:-1], "data.epochs=50,-1",
                      "hydra.launcher.array_parallelism=1"]) as sweep:
        job = sweep.job(0)
        sweep.wait_until(lambda: f"(Slurm job {job}): RUNNING" in sweep.text())
        subprocess.run(["scancel", job], check=True)
        output = sweep.finish()
    assert sweep.process.returncode == CLUSTER_FAILURE, output[-3000:]
    assert re.search(rf"member #0 \(Slurm job {job}; its log: \S+\) ended CANCELLED", output), output[-2000:]
    assert re.search(r"member #1 \(Slurm job \d+_1; its log: \S+\): Invalid configuration \(1 problem\):\n"
                     r"  - data.epochs: ", output), output[-2000:]
    assert "Traceback" not in output


def a_sweep_no_job_of_which_can_start_is_cancelled_after_max_pending_min(root: Path) -> None:
    """More CPUs per task than the node has: Slurm takes the job and leaves it pending for ever."""
    with Sweep(root, ["trainer.max_steps=2", "hydra.launcher.max_pending_min=0.1",
                      "hydra.launcher.cpus_per_task=64"]) as sweep:
        job = sweep.job()
        output = sweep.finish()
    assert sweep.process.returncode == CLUSTER_FAILURE, output[-3000:]
    assert re.search(rf"member #0 \(Slurm job {job}\): PENDING \(PartitionConfig\)", output)
    assert "no job of the sweep ran for hydra.launcher.max_pending_min=0.1 min, so they are cancelled" in output
    queue = subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True).stdout.split()
    assert job not in queue, queue


SCENARIOS = {  # by test id
    "a_cpu_sweep_with_the_defaults_runs_and_its_jobs_ask_for_no_gpu": a_cpu_sweep_with_the_defaults,
    "a_time_limit_and_a_requeue_lose_nothing_on_1_process": partial(a_time_limit_and_a_requeue, processes=1),
    "a_time_limit_and_a_requeue_lose_nothing_on_2_processes": partial(a_time_limit_and_a_requeue, processes=2),
    "too_many_time_limits_end_the_sweep_with_one_message": too_many_time_limits_end_the_sweep_with_one_message,
    "a_cancelled_member_and_a_member_with_a_bad_config_are_reported_apart":
        a_cancelled_member_and_a_member_with_a_bad_config_are_reported_apart,
    "a_sweep_no_job_of_which_can_start_is_cancelled_after_max_pending_min":
        a_sweep_no_job_of_which_can_start_is_cancelled_after_max_pending_min,
}


@pytest.fixture(scope="module")
def scenario_runs(request, tmp_path_factory) -> dict[str, Future]:
    """The selected `SCENARIOS`, all at once, each in a thread, until the last one has ended: each test then
    reports its own."""
    selected = [item.callspec.params["scenario"] for item in request.session.items
                if item.module is request.module and item.originalname == "test_scenario"]
    with ThreadPoolExecutor(max_workers=len(selected)) as pool:
        return {name: pool.submit(SCENARIOS[name], tmp_path_factory.mktemp(name)) for name in selected}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(scenario_runs, scenario):
    """One of `SCENARIOS`, which ran beside the others in `scenario_runs`."""
    scenario_runs[scenario].result()


def test_a_gpu_request_on_a_cpu_partition_is_refused_with_a_hint(tmp_path):
    sweep = Sweep(tmp_path, ["trainer.accelerator=auto", "trainer.max_steps=2"])
    output = sweep.finish()
    assert sweep.process.returncode == CLUSTER_FAILURE, output[-3000:]
    assert "rlcli train: error: Slurm refused the sweep's jobs" in output
    assert "a CPU run asks for none with trainer.accelerator=cpu" in output
    assert "Traceback" not in output
