"""`manifest.json` (rlcli/manifest.py): its git fields against what git itself says in a repository made
here, the package list against importlib.metadata, rank 0 alone writing it, resume and finish, and the
differences between manifests."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import pytest

import rlcli
from rlcli.manifest import RANK_VARIABLES, finish_manifest, git_state, manifest_differences, write_manifest

GIT_IDENTITY = ["-c", "user.name=test", "-c", "user.email=test@example.com"]


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch):
    """Each test starts as the first process of its run, whatever launched pytest."""
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *GIT_IDENTITY, *args], capture_output=True, check=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with one commit: ``pkg/code.py``, and an untracked ``venv/`` beside it."""
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "code.py").write_text("x = 1\n")
    git(root, "init", "-q")
    git(root, "add", "pkg")
    git(root, "commit", "-q", "-m", "first")
    (root / "venv").mkdir()
    (root / "venv" / "installed.py").write_text("y = 2\n")
    return root


def read(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def test_git_fields_are_what_git_says_clean_then_dirty(repo: Path):
    """Broken if the commit, the dirty flag or the diff's hash were not git's own (a wrong ref, a diff
    against the index, dirty always false)."""
    commit = git(repo, "rev-parse", "HEAD").decode().strip()
    assert git_state(repo / "pkg") == {"commit": commit, "dirty": False,
                                       "diff_sha256": hashlib.sha256(b"").hexdigest()}
    (repo / "pkg" / "code.py").write_text("x = 2\n")
    diff = git(repo, "diff", "--binary", "HEAD")
    assert b"+x = 2" in diff
    assert git_state(repo / "pkg") == {"commit": commit, "dirty": True, "diff_sha256": hashlib.sha256(diff).hexdigest()}
    git(repo, "add", "pkg")  # staged changes still differ from HEAD
    assert git_state(repo / "pkg")["diff_sha256"] == hashlib.sha256(diff).hexdigest()


def test_no_checkout_or_no_git_gives_null(repo: Path, tmp_path: Path, monkeypatch):
    """Broken if a directory outside any repository, an untracked one inside a repository (an installed copy
    in a venv of the checkout) or a machine without git raised or gave git fields."""
    outside = tmp_path / "outside"
    outside.mkdir()
    assert git_state(outside) is None
    assert git_state(repo / "venv") is None
    monkeypatch.setenv("PATH", str(outside))  # no git on the path
    assert git_state(repo / "pkg") is None


def test_the_manifest_takes_git_from_rlcli_s_own_checkout_not_the_working_directory(repo, tmp_path, monkeypatch):
    """Broken if the git fields came from the current directory (here another repository)."""
    package = Path(rlcli.__file__).parent
    try:
        expected = git(package, "rev-parse", "HEAD").decode().strip()
        git(package, "ls-files", "--error-unmatch", "--", ".")
    except subprocess.CalledProcessError:
        pytest.skip("rlcli is not running from a git checkout")
    monkeypatch.chdir(repo)
    write_manifest(tmp_path, "train", [])
    assert read(tmp_path)["git"]["commit"] == expected != git(repo, "rev-parse", "HEAD").decode().strip()


def test_contents_packages_and_versions(tmp_path: Path):
    """Broken if the package list or a version missed importlib.metadata's, or the overrides were lost."""
    write_manifest(tmp_path, "train", ["loss=gspo", "seed=3"])
    manifest = read(tmp_path)
    assert manifest["packages"]["torch"] == metadata.version("torch")
    assert manifest["packages"]["hydra-core"] == metadata.version("hydra-core")
    assert list(manifest["packages"]) == sorted(manifest["packages"])
    names = {re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower() for dist in metadata.distributions()}  # PEP 503
    assert set(manifest["packages"]) == names
    assert manifest["versions"]["torch"] == metadata.version("torch")
    assert manifest["versions"]["lightning"] == metadata.version("lightning")
    assert manifest["command"] == "train" and manifest["overrides"] == ["loss=gspo", "seed=3"]
    assert manifest["hardware"]["cpus"] >= manifest["hardware"]["cpus_usable"] >= 1
    assert manifest["hardware"]["memory_bytes"] > 2**20


@pytest.mark.parametrize("variable, value", [("LOCAL_RANK", "1"), ("NODE_RANK", "1"), ("SLURM_PROCID", "2"),
                                             ("RANK", "3")])
def test_only_rank_zero_writes(tmp_path: Path, monkeypatch, variable: str, value: str):
    """Broken if a process other than the run's first wrote or finished the manifest."""
    monkeypatch.setenv(variable, value)
    write_manifest(tmp_path, "train", [])
    assert not (tmp_path / "manifest.json").exists()
    monkeypatch.setenv(variable, "0")  # rank 0's copy of the same variable: it writes
    write_manifest(tmp_path, "train", [])
    before = (tmp_path / "manifest.json").read_text()
    monkeypatch.setenv(variable, value)
    finish_manifest(tmp_path, "done")
    assert (tmp_path / "manifest.json").read_text() == before


def test_finish_adds_the_end_and_how_the_run_ended(tmp_path: Path):
    """Broken if finishing lost the start, or did not record the end time and status."""
    write_manifest(tmp_path, "train", [])
    started = read(tmp_path)["started"]
    finish_manifest(tmp_path, "failed: out of memory")
    manifest = read(tmp_path)
    assert manifest["started"] == started
    assert manifest["status"] == manifest["starts"][0]["status"] == "failed: out of memory"
    ended = datetime.fromisoformat(manifest["ended"])
    assert ended.tzinfo == UTC and ended >= datetime.fromisoformat(started)
    assert manifest["starts"][0]["ended"] == manifest["ended"]


def test_a_finish_the_storage_refuses_is_a_warning(tmp_path: Path, caplog):
    """Broken if a manifest that cannot be written at the end raised over the run's own outcome, or said
    nothing."""
    write_manifest(tmp_path, "train", [])
    before = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json.tmp").mkdir()  # where the replacement is written: the write fails
    finish_manifest(tmp_path, "done")
    assert (tmp_path / "manifest.json").read_text() == before
    assert f"cannot write {tmp_path / 'manifest.json'}" in caplog.text


def test_resume_keeps_the_first_start_and_appends(tmp_path: Path):
    """Broken if a resume overwrote the first start, its end or its overrides, or did not record itself
    and what changed."""
    write_manifest(tmp_path, "train", ["seed=1"])
    finish_manifest(tmp_path, "stopped by signal")
    first = read(tmp_path)
    time.sleep(0.01)
    write_manifest(tmp_path, "train", ["seed=1", "resume=auto"])
    resumed = read(tmp_path)
    assert resumed["started"] == first["started"] == first["starts"][0]["started"]
    assert resumed["overrides"] == ["seed=1"]
    assert resumed["starts"][0] == first["starts"][0]  # its end and status kept
    assert resumed["starts"][0]["status"] == "stopped by signal"
    second = resumed["starts"][1]
    assert second["started"] > first["started"]
    assert second["changed"] == {"overrides": ["seed=1", "resume=auto"]}
    assert resumed["ended"] is None and resumed["status"] is None  # running again
    finish_manifest(tmp_path, "done")
    assert read(tmp_path)["status"] == read(tmp_path)["starts"][1]["status"] == "done"
    assert read(tmp_path)["starts"][0]["status"] == "stopped by signal"


def test_a_file_that_is_not_a_manifest_is_kept_aside(tmp_path: Path):
    """Broken if a damaged manifest stopped the run or was overwritten without a trace."""
    (tmp_path / "manifest.json").write_text("not json")
    write_manifest(tmp_path, "train", [])
    assert (tmp_path / "manifest.json.unreadable").read_text() == "not json"
    assert len(read(tmp_path)["starts"]) == 1


def test_differences_find_a_changed_package_and_ignore_times(tmp_path: Path):
    """Broken if the differences missed a package version or a status, or listed the times, the starts or
    the overrides, which differ between any two members."""
    for name, seed in (("a", 0), ("b", 1)):
        (tmp_path / name).mkdir()
        write_manifest(tmp_path / name, "train", [f"seed={seed}"])
        time.sleep(0.01)
        finish_manifest(tmp_path / name, "done")
    a, b = read(tmp_path / "a"), read(tmp_path / "b")
    assert a["started"] != b["started"] and a["ended"] != b["ended"]
    assert manifest_differences({"a": a, "b": b}) == {}
    b["packages"]["torch"] = "0.0.1"
    b["status"] = "failed: NaN loss"
    del b["packages"]["transformers"]
    assert manifest_differences({"a": a, "b": b}) == {
        "packages.torch": {"a": metadata.version("torch"), "b": "0.0.1"},
        "packages.transformers": {"a": metadata.version("transformers"), "b": None},
        "status": {"a": "done", "b": "failed: NaN loss"},
    }
