"""The step-source seam: the data kind table, and `after_update` called after every optimizer update."""

from __future__ import annotations

import csv

import pytest
from fault_injection import callbacks_override

from rlcli.commands.train import train
from rlcli.conf.schema import TrainConfig
from rlcli.training.sources import DATA_KINDS, GROUPS_OF_DATA_KINDS
from rlcli.training.sources.files import RolloutFileSource
from train_helpers import compose_train_config


def test_every_data_kind_of_the_schema_has_a_source_and_the_groups_it_reads():
    import typing

    kinds = {typing.get_args(typing.get_type_hints(c)["kind"])[0]
             for c in typing.get_args(typing.get_type_hints(TrainConfig)["data"])}
    assert kinds == set(DATA_KINDS)
    assert GROUPS_OF_DATA_KINDS == ("rollout", "task", "publish", "sample")


@pytest.mark.slow
def test_after_update_follows_every_step_with_the_policy_version(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(RolloutFileSource, "after_update", lambda self, step: calls.append(step))
    overrides = ["data=rollouts", "trainer.max_steps=3", "trainer.accumulate_microbatches=1", "logger=none",
                 *callbacks_override("NanLossAt", step=2, rank=0)]
    module = train(compose_train_config(overrides), tmp_path)
    with (tmp_path / "metrics.csv").open() as f:
        bad_steps = [row["bad_steps"] for row in csv.DictReader(f)]
    assert bad_steps == ["0.0", "1.0", "1.0", "1.0"]  # step 2 made no update, so a fourth step ran
    assert calls == [1, 2, 3, 4] and module.steps_done == 4  # step 2 made no update but is a version
