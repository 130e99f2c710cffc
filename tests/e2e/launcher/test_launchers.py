"""Sweeps through submitit's local executor (Slurm's own tests, on a real cluster, are in test_slurm.py)."""

from __future__ import annotations

import pytest

from train_helpers import run_rlcli

pytestmark = pytest.mark.slow


def test_two_member_sweep_through_the_local_launcher(tmp_path):
    result = run_rlcli(["train", "-m", "launcher=local", "loss=grpo,gspo", "trainer.max_steps=2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    members = sorted((tmp_path / "multirun").glob("*/*/[0-9]"))
    assert [m.name for m in members] == ["0", "1"]
    for member, loss in zip(members, ["grpo", "gspo"]):
        assert len((member / "metrics.csv").read_text().splitlines()) == 3
        assert f"loss={loss}" in (member / ".hydra" / "overrides.yaml").read_text()
    assert list((members[0].parent / ".submitit").glob("*/*_result.pkl"))  # submitit ran them
