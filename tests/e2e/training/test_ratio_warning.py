"""The warning that the losses cannot differ: on-policy with one update per batch the ratio is 1 and the
clip never acts, so grpo, gspo, ... make the same update (docs/concepts/math.md)."""

from __future__ import annotations

import warnings

from rlcli.callbacks.off_policy import RATIO_AT_ONE_STEPS
from rlcli.commands.train import train
from train_helpers import compose_train_config

SAYS = "runs that differ only in the loss will not differ"


def warnings_of(tmp_path, overrides: list[str]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(compose_train_config(["trainer.max_steps=6", "logger=none", *overrides]), tmp_path / "run")
    return [str(w.message) for w in caught if SAYS in str(w.message)]


def test_a_default_run_warns_once_naming_the_settings_that_make_losses_differ(tmp_path):
    """Six on-policy steps of one update each: the ratio stays 1, so exactly one warning after step 5."""
    assert RATIO_AT_ONE_STEPS == 5
    [message] = warnings_of(tmp_path, [])
    for setting in ("trainer.minibatches > 1", "trainer.batch_epochs > 1", "data=rollouts", "rlcli loop"):
        assert setting in message


def test_several_updates_per_batch_move_the_ratio_and_say_nothing(tmp_path):
    """With trainer.minibatches=4 the later updates of a batch see a moved policy (ratio != 1): no warning."""
    assert warnings_of(tmp_path, ["trainer.minibatches=4"]) == []
