"""A stand-in for Slurm's sbatch, srun and sacct on one machine, for the launcher tests.

``fake_slurm.py sbatch SCRIPT`` keeps a copy of the submission script in $FAKE_SLURM_DIR, runs each
array task of it with bash in the background and prints the job id; ``srun [OPTIONS] CMD...`` runs
CMD as task 0 of 1 with Slurm's variables; ``sacct ... -j ID`` reports RUNNING, then COMPLETED or
FAILED for each task. ``squeue`` and ``scancel`` do nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

STATE_DIR = Path(os.environ["FAKE_SLURM_DIR"])
SRUN_OPTIONS_WITH_VALUE = {"--output", "--error", "-o", "-e", "-n", "--ntasks", "-N", "--nodes", "-c",
                           "--cpus-per-task", "--gpus", "--gres", "-J", "--job-name"}


def sbatch(script: str) -> None:
    text = Path(script).read_text()
    job_id = str(1000 + len(list(STATE_DIR.glob("sbatch_*.sh"))))
    (STATE_DIR / f"sbatch_{job_id}.sh").write_text(text)
    array = re.search(r"#SBATCH --array=0-(\d+)", text)
    for task in range(int(array.group(1)) + 1 if array else 1):
        env = dict(os.environ, SLURM_JOB_ID=f"{job_id}{task}", SLURM_ARRAY_JOB_ID=job_id,
                   SLURM_ARRAY_TASK_ID=str(task), SLURM_JOB_NAME="rlcli-test", SLURM_JOB_NUM_NODES="1",
                   SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost")
        state = STATE_DIR / f"state_{job_id}_{task}"
        subprocess.Popen(["bash", "-c", f'bash "{script}"; echo $? > "{state}"'], env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"Submitted batch job {job_id}")


def srun(args: list[str]) -> int:
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 2 if args[i] in SRUN_OPTIONS_WITH_VALUE else 1
    env = dict(os.environ, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1", SLURM_NODEID="0",
               SLURM_STEP_NODELIST="localhost")
    return subprocess.call(args[i:], env=env)


def sacct(args: list[str]) -> None:
    print("JobID|State|NodeList")
    for job_id in [args[i + 1] for i, a in enumerate(args) if a == "-j"]:
        for script in STATE_DIR.glob(f"sbatch_{job_id}.sh"):
            array = re.search(r"#SBATCH --array=0-(\d+)", script.read_text())
            for task in range(int(array.group(1)) + 1 if array else 1):
                state = STATE_DIR / f"state_{job_id}_{task}"
                if not state.exists() or not state.read_text().strip():
                    status = "RUNNING"
                else:
                    status = "COMPLETED" if state.read_text().strip() == "0" else "FAILED"
                print(f"{job_id}_{task}|{status}|localhost")


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "sbatch":
        sbatch(rest[-1])
    elif command == "srun":
        sys.exit(srun(rest))
    elif command == "sacct":
        sacct(rest)
