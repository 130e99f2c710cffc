"""`launcher=slurm`: a sweep's members as one Slurm job array, watched by the driver until each ends.

hydra-submitit-launcher submits the array and runs each member in its job; this launcher adds what the
user of the driver needs to see: each member's state as it changes, with Slurm's reason while it waits, a
bounded wait when no job of the sweep can start (``hydra.launcher.max_pending_min``), and one message for
the members that did not finish: a `ClusterError` (exit code `CLUSTER_FAILURE`) when Slurm refused,
cancelled or timed them out, a `UserError` (exit 2) when a member stopped on its own config or data.
"""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from omegaconf import OmegaConf

from rlcli.errors import ClusterError, UserError
from rlcli.slurm.queue import MemberState, accounted, states, unfinished

log = logging.getLogger(__name__)
POLL_S = 5  # how often the driver asks squeue about the sweep's jobs
RUNNING = frozenset({"RUNNING", "COMPLETING"})
USER_ERROR = "rlcli train: error: "  # how a member that stopped on its config or data says why


@dataclass
class SlurmLauncherConf(SlurmQueueConf):
    """hydra-submitit-launcher's Slurm options and rlcli's own."""

    _target_: str = "hydra_plugins.rlcli_launcher.SlurmLauncher"
    # give up (cancel the sweep's jobs, exit CLUSTER_FAILURE) once none of them has run for this long; null: wait
    max_pending_min: float | None = 60.0


ConfigStore.instance().store(group="hydra/launcher", name="rlcli_slurm", node=SlurmLauncherConf(), provider="rlcli")


class SlurmSweepLauncher(submitit_launcher.SlurmLauncher):
    """The launcher of `launcher=slurm`; Hydra builds it as `hydra_plugins.rlcli_launcher.SlurmLauncher`."""

    def __init__(self, max_pending_min: float | None = 60.0, **params: Any) -> None:
        super().__init__(**params)
        self.max_pending_min = max_pending_min

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """In the job: the member's run, its stderr free of the warning about the optional local config folder."""
        from rlcli.conf import quiet_local_config_folder

        quiet_local_config_folder()
        return super().__call__(*args, **kwargs)

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        import submitit
        from submitit.core.utils import FailedJobError

        params = dict(self.params)
        executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                         slurm_max_num_timeout=params.pop("max_num_timeout"))
        shared = set(OmegaConf.structured(BaseQueueConf).keys())  # the options submitit takes without "slurm_"
        executor.update_parameters(**{key if key in shared else f"slurm_{key}": value for key, value in params.items()})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("Slurm sweep of %d member(s) in %s, each asking %s", len(job_overrides), sweep_dir, self._request())
        numbers = [initial_job_idx + i for i in range(len(job_overrides))]
        for number, overrides in zip(numbers, job_overrides):
            log.info("\t#%d : %s", number, " ".join(overrides))
        calls = [(list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}", _singleton_state())
                 for number, overrides in zip(numbers, job_overrides)]
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's error, then raises it
                jobs = executor.map_array(self, *zip(*calls))
        except FailedJobError as err:
            raise ClusterError(self._refused(str(err))) from None
        return self._results(jobs, numbers, self._watch(jobs, numbers))

    def _request(self) -> str:
        """What each job asks Slurm for, as the user set it (hydra.launcher.*)."""
        p = self.params
        gpus = f"{p['gpus_per_node']} GPU(s) per node" if p.get("gpus_per_node") else "no GPU"
        memory = f"{p['mem_gb']} GB per node" if p.get("mem_gb") else "the partition's default memory"
        return (f"{p['nodes']} node(s) x {p['tasks_per_node']} task(s) x {p.get('cpus_per_task') or 1} CPU(s), "
                f"{memory}, {gpus}, {p['timeout_min']} min, partition {p.get('partition') or '(default)'}")

    def _refused(self, sbatch_error: str) -> str:
        message = f"Slurm refused the sweep's jobs ({self._request()}): {sbatch_error.strip()}"
        if "gres" in sbatch_error.lower() and self.params.get("gpus_per_node"):
            message += ("\nthe partition has no GPUs for them: a CPU run asks for none with trainer.accelerator=cpu")
        return message

    def _watch(self, jobs, numbers: list[int]) -> dict[str, MemberState]:
        """Until every member has ended: log each change of state (and reason), and give up after
        ``max_pending_min`` in which no job of the sweep ran. The last state seen of each job."""
        number = {job.job_id: n for job, n in zip(jobs, numbers)}
        seen: dict[str, MemberState] = {}
        last_ran = time.monotonic()
        while True:
            now = states(list(number))  # None: squeue could not answer this time
            for job_id, state in (now or {}).items():
                if seen.get(job_id) != state:
                    reason = f" ({state.reason})" if state.has_reason else ""
                    log.info("member #%d (Slurm job %s): %s%s", number[job_id], job_id, state.state, reason)
                    seen[job_id] = state
            if now is not None and seen.keys() == number.keys() and not any(map(unfinished, now.values())):
                return seen  # a job seen before and missing now has ended long enough ago to be forgotten
            if now is None or any(s.state in RUNNING for s in now.values()):
                last_ran = time.monotonic()
            elif self.max_pending_min is not None and time.monotonic() - last_ran > self.max_pending_min * 60:
                waiting = {job_id: s for job_id, s in now.items() if unfinished(s)}
                subprocess.run(["scancel", *waiting], capture_output=True, timeout=60)
                raise ClusterError(
                    f"no job of the sweep ran for hydra.launcher.max_pending_min={self.max_pending_min:g} min, so "
                    f"they are cancelled: {', '.join(f'{i} {s.state} ({s.reason})' for i, s in waiting.items())}. "
                    f"Each asks {self._request()}; compare with what the partition offers (sinfo -N -l), or wait "
                    "longer with hydra.launcher.max_pending_min=null")
            time.sleep(POLL_S)

    def _results(self, jobs, numbers: list[int], seen: dict[str, MemberState]) -> list[JobReturn]:
        """Each member's JobReturn; one error naming every member that did not finish."""
        from submitit.core.utils import UncompletedJobError

        # the members without a result, each with the state squeue showed last (never seen: still pending)
        lost = {job.job_id: seen.get(job.job_id, MemberState("PENDING"))
                for job in jobs if not job.paths.result_pickle.exists()}
        forgotten = [job_id for job_id, last in lost.items() if unfinished(last)]
        ends = {**seen, **(accounted(forgotten) if forgotten else {})}
        results, cluster, user = [], [], []
        for job, number in zip(jobs, numbers):
            where = f"member #{number} (Slurm job {job.job_id}; its log: {job.paths.stderr})"
            if job.job_id in lost:
                message = _user_error(job.paths.stderr)
                if message is not None:
                    user.append(f"{where}: {message}")
                elif ends[job.job_id].state == "UNKNOWN":
                    cluster.append(f"{where} left Slurm's queue while {lost[job.job_id].state}, and Slurm's "
                                   "accounting has no record of its end (cancelled before it started?)")
                else:
                    end = ends[job.job_id]
                    reason = f", reason {end.reason}" if end.has_reason else ""
                    cluster.append(f"{where} ended {end.state}{reason}")
                continue
            result = job.results()[0]
            # (a failed JobReturn raises its exception when asked for its value: look at it without raising)
            if result.status == JobStatus.FAILED and isinstance(result._return_value, UncompletedJobError):
                cluster.append(f"{where} was not requeued: {result._return_value} (hydra.launcher.max_num_timeout="
                               f"{self.params['max_num_timeout']}, timeout_min={self.params['timeout_min']}); "
                               "its checkpoints are kept")
            results.append(result)
        if cluster:
            raise ClusterError("\n".join(cluster + user))
        if user:
            raise UserError("\n".join(user))
        return results


def _user_error(stderr: Path) -> str | None:
    """The ``rlcli train: error: ...`` message a member stopped with (and the lines that follow it), if any."""
    text = stderr.read_text(errors="replace") if stderr.exists() else ""
    start = text.rfind(USER_ERROR)
    if start < 0:
        return None
    first, *rest = text[start + len(USER_ERROR):].splitlines()
    return "\n".join([first, *(line for line in rest if line.startswith("  "))])


def _singleton_state():
    from hydra.core.singleton import Singleton

    return Singleton.get_state()
