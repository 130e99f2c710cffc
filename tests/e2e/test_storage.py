"""Storage faults and the run directory: a full disk or an unwritable run directory gives one message
naming the path, exit 2, the previous checkpoints intact and no partial file; a run directory in use
by a live run is refused."""

from __future__ import annotations

import fcntl
import resource
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from rlcli.callbacks.resume import read_run
from train_helpers import run_rlcli

CHECKPOINTED = ["trainer.checkpoint_every=1", "logger=csv"]


@contextmanager
def tmpfs(path: Path, size: str, *options: str):
    """A small tmpfs mounted at ``path`` (root only: skipped where mounting is not permitted)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def one_clear_message(result: subprocess.CompletedProcess, needle: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("rlcli train: error:")]
    assert errors and all(needle in line for line in errors), result.stderr[-3000:]


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_the_space_needed_and_the_older_checkpoints_intact(tmp_path):
    # the tiny model's checkpoint is about 1 MiB: two fit, the third does not
    with tmpfs(tmp_path / "disk", "2500k") as disk:
        result = run_rlcli(["train", f"hydra.run.dir={disk}/run", "trainer.max_steps=5", *CHECKPOINTED], tmp_path)
        one_clear_message(result, "No space left on device")
        assert "step-3.ckpt" in result.stderr and "it needs about 1.0 MiB" in result.stderr
        assert checkpoint_names(disk / "run") == ["step-1.ckpt", "step-2.ckpt"]
        run, step = read_run(disk / "run" / "checkpoints" / "step-2.ckpt")
        assert step == 2
        full = torch.load(disk / "run" / "checkpoints" / "step-2.ckpt", weights_only=True)
        assert all(torch.isfinite(v).all() for v in full["state_dict"].values())


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))  # Python ignores SIGXFSZ: writes fail EFBIG


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_a_write_that_fails_midway_leaves_no_partial_file_and_every_process_exits(tmp_path, processes):
    distributed = ["trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp"] if processes == 2 else []
    args = ["train", "hydra.run.dir=run", "trainer.max_steps=3", *CHECKPOINTED, *distributed]
    result = run_rlcli(args, tmp_path, preexec_fn=_limit_file_size)
    one_clear_message(result, "File too large")
    assert "step-1.ckpt" in result.stderr
    assert checkpoint_names(tmp_path / "run") == []


def test_a_run_directory_that_cannot_be_created_is_one_message(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_rlcli(["train", f"hydra.run.dir={blocker}/run", "trainer.max_steps=1"], tmp_path)
    one_clear_message(result, f"{blocker}/run: Not a directory")


def test_a_read_only_run_directory_is_one_message(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", "ro") as read_only:
        result = run_rlcli(["train", f"hydra.run.dir={read_only}/run", "trainer.max_steps=1"], tmp_path)
        one_clear_message(result, "Read-only file system")


@pytest.mark.slow
def test_a_run_directory_in_use_is_refused_and_free_again_once_its_run_ends(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with (run_dir / ".lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a live run holds
        held.write("4242")
        held.flush()
        refused = run_rlcli(["train", f"hydra.run.dir={run_dir}", "trainer.max_steps=1"], tmp_path)
        one_clear_message(refused, "is in use by another run (process 4242)")
        assert not (run_dir / "metrics.csv").exists() and not (run_dir / "config.yaml").exists()
    result = run_rlcli(["train", f"hydra.run.dir={run_dir}", "trainer.max_steps=1"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
