"""``hydra/sweeper=optuna`` with rlcli's objective: hydra-optuna-sweeper's own config, its ``direction``
following ``objective.direction`` (``hydra.sweeper.direction=...`` still sets it).

A YAML file cannot do it: ``hydra/sweeper/optuna.yaml`` in rlcli's config folder would hide the plugin's
config from its own defaults list, and the sweeper's config has no place for a key that only Optuna has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf


@dataclass
class ObjectiveOptunaSweeperConf(OptunaSweeperConf):
    direction: Any = "${objective.direction}"


def register_sweepers() -> None:
    """Store rlcli's ``hydra/sweeper/optuna`` in Hydra's config store, over the plugin's: after Hydra's scan
    of its plugins, which runs the plugin's module (and its store) once per process."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()
    ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=ObjectiveOptunaSweeperConf,
                                 provider="rlcli")
