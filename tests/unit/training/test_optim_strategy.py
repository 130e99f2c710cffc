"""Optimizers and strategies by name: each registry entry has its schema class and YAML file, and builds."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import rlcli.conf
from rlcli.conf.schema import TrainConfig
from rlcli.training.optim import OPTIMIZERS, build_optimizer
from rlcli.training.strategy import STRATEGIES, build_strategy

CONF = Path(rlcli.conf.__file__).parent


def schema_names(group: str) -> set[str]:
    """The ``name`` values of the schema classes of a config group."""
    members = typing.get_args(typing.get_type_hints(TrainConfig)[group])
    return {typing.get_args(typing.get_type_hints(cls)["name"])[0] for cls in members}


@pytest.mark.parametrize(("group", "registry"), [("optimizer", OPTIMIZERS), ("strategy", STRATEGIES)])
def test_every_registered_name_has_its_schema_class_and_yaml_file(group, registry):
    assert schema_names(group) == set(registry.names())
    assert {path.stem for path in (CONF / group).glob("*.yaml")} == set(registry.names())


@pytest.mark.parametrize(("name", "cls"), [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)])
def test_build_optimizer_by_name_with_the_yaml_defaults(name, cls):
    cfg = OmegaConf.load(CONF / "optimizer" / f"{name}.yaml")
    cfg.lr = 0.5
    optimizer, schedule = build_optimizer(cfg, total_steps=4, policy=torch.nn.Linear(2, 2))
    assert type(optimizer) is cls and optimizer.param_groups[0]["lr"] == 0.5
    assert schedule.get_last_lr() == [0.5]  # one group, no warmup


def test_build_strategy_by_name():
    assert build_strategy(OmegaConf.load(CONF / "strategy" / "auto.yaml"), None, world_size=1) == ("auto", None)
    with pytest.raises(ValueError, match="unknown strategy 'zero'; expected one of: auto, ddp, fsdp, fsdp2"):
        build_strategy(OmegaConf.create({"name": "zero"}), None, world_size=1)
