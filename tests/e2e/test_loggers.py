"""Loggers: metrics.csv always, wandb offline without an API key, TensorBoard, sweep members."""

from __future__ import annotations

import pytest

from rlcli.loggers import wandb_mode
from train_helpers import run_rlcli


@pytest.mark.parametrize(
    "env, configured, api_key, expected",
    [
        ({"WANDB_MODE": "disabled"}, "online", True, "disabled"),  # WANDB_MODE wins over everything
        ({}, "offline", True, "offline"),
        ({}, None, True, "online"),
        ({}, None, False, "offline"),  # no API key: never try the network
    ],
)
def test_wandb_mode(monkeypatch, tmp_path, env, configured, api_key, expected):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if api_key:
        monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(configured) == expected


@pytest.mark.slow
def test_sweep_with_wandb_and_tensorboard_gives_each_member_its_own_runs(tmp_path):
    result = run_rlcli(
        ["train", "-m", "loss=grpo,gspo", "trainer.max_steps=2", "logger=[wandb,tensorboard]"],
        cwd=tmp_path, wandb_mode="offline",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    members = sorted((tmp_path / "multirun").glob("*/*/[0-9]*"))
    assert [m.name for m in members] == ["0", "1"]
    run_ids = set()
    for member in members:
        assert len((member / "metrics.csv").read_text().splitlines()) == 3
        assert list((member / "tensorboard").glob("events.out.tfevents.*"))
        [offline_run] = list((member / "wandb").glob("offline-run-*"))
        run_ids.add(offline_run.name.rsplit("-", 1)[-1])
    assert len(run_ids) == 2  # one wandb run per member, closed between members
    assert "name: gspo" in (members[1] / "config.yaml").read_text()


def test_a_failure_while_metrics_csv_is_rewritten_leaves_the_old_file(tmp_path, monkeypatch):
    """A resumed run cuts metrics.csv back by rewriting it: a kill (here: an error) in the middle of
    that must leave the whole previous history, never an empty or half-written file."""
    import csv

    from rlcli.loggers.metrics_csv import MetricsCSVLogger

    path = tmp_path / "metrics.csv"
    logger = MetricsCSVLogger(path)
    for step in (1, 2, 3):
        logger.log_metrics({"loss": 0.5 * step}, step=step)
    before = path.read_text()

    def interrupted(self, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(csv.DictWriter, "writerows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        MetricsCSVLogger(path).resume_at(2)
    assert path.read_text() == before
    monkeypatch.undo()
    MetricsCSVLogger(path).resume_at(2)
    assert path.read_text().splitlines() == before.splitlines()[:3]  # header, steps 1 and 2
