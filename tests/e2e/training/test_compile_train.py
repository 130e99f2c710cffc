"""``model.compile=true`` end to end: two training steps with a KL penalty to the initial policy (a compiled
reference model) equal eager's within float32 rounding, and a machine where torch.compile cannot run gets one clear
message.

Tolerance: compiled and eager float32 differ only in the order of their sums (inductor fuses and reorders them);
rounding a sum of n float32 terms in another order moves it by at most about n·eps of its terms' magnitudes
(eps = 2**-23). The longest sums of the tiny model run over 128 terms (its intermediate size), so every metric
and every exported weight must agree within 128·eps relative to its scale (≈ 1.5e-5); measured: ≤ 2e-8
relative. SGD keeps a gradient's error an error of the same size in the weights (Adam's normalisation would
blow up the rounding of near-zero gradients).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from factories import initial_policy
from rlcli.commands.train import train
from train_helpers import compose_train_config, run_rlcli

TOLERANCE = 128 * torch.finfo(torch.float32).eps


def _overrides(rollouts: Path, compile_: bool) -> list[str]:
    return ["data=rollouts", f"data.paths=[{rollouts}]", "data.max_tokens=32", "trainer.max_steps=2",
            "trainer.accumulate_microbatches=2", "optimizer=sgd", "optimizer.lr=1e-2", "logger=csv",
            "kl.coef=0.1", "kl.reference=initial", f"model.compile={str(compile_).lower()}"]


def _run(tmp_path: Path, rollouts: Path, compile_: bool):
    """The trained module, the metrics rows and the exported weights of two steps from seed 0."""
    run_dir = tmp_path / f"compile-{compile_}"
    module = train(compose_train_config(_overrides(rollouts, compile_)), run_dir)
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    return module, rows, load_file(run_dir / "export" / "model.safetensors")


@pytest.mark.slow  # compiling on CPU: ~20 s without inductor's cache
def test_two_compiled_steps_equal_eager_within_float32_rounding(tmp_path, small_rollouts):
    """Same seed, same data: every metric of both steps (the KL to the reference among them) and every exported
    weight agree within the tolerance, while training moved the weights far more than it; the reference model is
    compiled too (with dynamo's caches emptied, its forward compiles). Fails if the compiled body computes anything
    else than eager's (e.g. documents of a packed row attending to each other, or a wrong gradient), or if the
    reference, a copy of the policy, is left eager (a copy of a compiled module is not compiled)."""
    _, eager_rows, eager_weights = _run(tmp_path, small_rollouts, False)
    module, compiled_rows, compiled_weights = _run(tmp_path, small_rollouts, True)

    assert [r["step"] for r in compiled_rows] == [r["step"] for r in eager_rows] == ["1", "2"]
    for eager, compiled in zip(eager_rows, compiled_rows):
        assert eager.keys() == compiled.keys()
        for key in eager:
            if eager[key]:
                assert math.isclose(float(compiled[key]), float(eager[key]), rel_tol=TOLERANCE, abs_tol=TOLERANCE), key

    initial = initial_policy(compose_train_config(_overrides(small_rollouts, False))).state_dict()
    assert eager_weights.keys() == compiled_weights.keys()
    moved = 0.0
    for name, weight in eager_weights.items():
        atol = TOLERANCE * weight.abs().max().item()
        torch.testing.assert_close(compiled_weights[name], weight, rtol=0, atol=atol, msg=name)
        moved = max(moved, (weight - initial[name]).abs().max().item() / atol)
    assert moved > 100  # the steps' updates dwarf the tolerance, so a wrong gradient shows

    torch._dynamo.reset()
    compiled_before = counters["frames"]["ok"]
    with torch.no_grad():
        module.reference.policy.base_model(input_ids=torch.arange(5)[None], use_cache=False)
    assert counters["frames"]["ok"] == compiled_before + 1


@pytest.mark.slow  # a subprocess: ~8 s
def test_no_cxx_compiler_exits_2_naming_model_compile(tmp_path, small_rollouts):
    """``rlcli train model.compile=true`` where inductor finds no C++ compiler (CXX names one that does not
    exist): exit 2, one message naming model.compile and what to do, no traceback. Fails if the compile is not
    checked when the policy is built (the first step would fail with inductor's traceback)."""
    result = run_rlcli(["train", *_overrides(small_rollouts, True)], cwd=tmp_path,
                       extra_env={"CXX": str(tmp_path / "no-such-c++")})
    assert result.returncode == 2, result.stderr
    output = result.stdout + result.stderr
    assert "model.compile: torch.compile cannot run here" in output
    assert "model.compile=false" in output
    assert "Traceback" not in output
