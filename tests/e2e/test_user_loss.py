"""A loss of the user's own, by `_target_`: one class and one YAML file, no change to rlcli."""

from __future__ import annotations

import csv
import os

import pytest

from train_helpers import run_rlcli

USER_LOSS = '''
from dataclasses import dataclass, field

import torch

from rlcli.modules import LOSSES, PolicyLoss, RatioUnits


@LOSSES.register()
@dataclass(frozen=True)
class Reinforce(PolicyLoss):
    """l_t = -coef * A_t * lp_t: plain REINFORCE with a scale."""

    name = "reinforce"
    sequence_level = False
    coef: float = field(default=1.0, metadata={"gt": 0})

    def per_token(self, logprobs, inputs):
        log_ratio = inputs.log_ratio(logprobs)  # [N]
        losses = torch.where(inputs.mask > 0, -self.coef * inputs.labelled_advantages * logprobs, 0.0)  # [N]
        return losses, RatioUnits.of_tokens(log_ratio.detach(), inputs)
'''

USER_YAML = """\
_target_: my_losses.Reinforce
name: reinforce
coef: 1.0
"""


@pytest.fixture
def user_project(tmp_path):
    (tmp_path / "my_losses.py").write_text(USER_LOSS)
    (tmp_path / "rlcli_local" / "loss").mkdir(parents=True)
    (tmp_path / "rlcli_local" / "loss" / "reinforce.yaml").write_text(USER_YAML)
    return tmp_path


def first_loss(run_dir):
    with (run_dir / "metrics.csv").open() as f:
        return float(next(csv.DictReader(f))["loss"])


@pytest.mark.slow
def test_a_user_loss_trains_from_its_yaml_and_its_options_reach_it(user_project, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(user_project), os.environ.get("PYTHONPATH", "")]))
    common = ["train", "loss=reinforce", "allow_targets=[my_losses]", "data=rollouts", "trainer.max_steps=2"]
    for coef in (1, 3):
        result = run_rlcli([*common, f"loss.coef={coef}", f"hydra.run.dir=coef{coef}"], cwd=user_project)
        assert result.returncode == 0, result.stderr[-3000:]
    # the first step scores the same weights and documents: the loss scales with the option
    assert first_loss(user_project / "coef3") == pytest.approx(3 * first_loss(user_project / "coef1"), rel=1e-6)
    assert first_loss(user_project / "coef1") != 0

    refused = run_rlcli([*common, "loss.coef=0", "hydra.run.dir=zero"], cwd=user_project)
    assert refused.returncode == 2 and "loss.coef: must be > 0, got 0" in refused.stderr
    assert "Traceback" not in refused.stderr
