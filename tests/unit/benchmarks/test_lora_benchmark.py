"""Smoke test of ``benchmarks/lora.py`` on a one-layer model (the real run is by hand, see its docstring)."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from benchmarks import lora

MODEL = lora._shape("32x64x1x2x64")  # hidden x intermediate x layers x heads x vocab
SETTINGS = dict(model=MODEL, device="cpu", attention="sdpa", kl_coef=0.05, max_tokens=64, documents=4,
                min_completion=4, max_completion=8)
# embedding and head 64 x 32 each; q, k, v, o 32 x 32; gate, up, down 32 x 64; two norms in the layer, one after
FULL_PARAMETERS = 2 * 64 * 32 + 4 * 32 * 32 + 3 * 32 * 64 + 3 * 32
# adapters of rank r on every linear layer but the head hold r * (in + out) parameters: q, k, v, o are 32 -> 32,
# gate and up 32 -> 64, down 64 -> 32
LORA_PARAMETERS_PER_RANK = 4 * (32 + 32) + 2 * (32 + 64) + (64 + 32)


@pytest.fixture(scope="module")
def timed():
    return lora.time_configurations(SETTINGS, ranks=[2], repeats=2, clock=time.process_time)


def test_a_step_updates_what_trains():
    """Full fine-tuning changes every weight, LoRA only its adapters (B from zero), through the optimizer's
    step; fails when the step skips ``optimizer.step()`` or the adapters are not added."""
    for rank in (0, 2):
        c = lora.build(SETTINGS, rank)
        before = {name: value.clone() for name, value in c.policy.state_dict().items()}
        c.step()
        changed = {name for name, value in c.policy.state_dict().items() if not torch.equal(value, before[name])}
        if rank:
            assert changed == {name for name in before if ".lora_B." in name}  # A: no gradient while B = 0
            assert (c.trainable, c.total) == (LORA_PARAMETERS_PER_RANK * rank, FULL_PARAMETERS + c.trainable)
        else:
            assert changed == set(before) and c.trainable == c.total == FULL_PARAMETERS


def test_the_configurations_are_timed_in_turns_with_the_publish(timed):
    assert [r["config"] for r in timed] == ["full", "lora2"]
    full, adapted = timed
    assert full["step_ratio"] == 1 and len(adapted["step_times_s"]) == 2 and adapted["step_s"] > 0
    assert "merge_s" not in full and adapted["merge_s"] > 0 and adapted["adapter_export_s"] > 0
    # float32 files: the adapters' bytes and a header, against every base weight's
    assert 4 * adapted["trainable"] < adapted["adapter_bytes"] < 4 * full["total"] < adapted["merged_bytes"]


def test_the_table_names_every_configuration(timed):
    rows = [r | dict(peak_mib=100.0, peak_is_lower_bound=False, memory_ratio=0.5) for r in timed]
    table = lora.format_table(dict(rows=rows, documents=4, completion_range=[4, 8], kl_coef=0.05,
                                   device_name="cpu", threads=1, repeats=2, timer="wall time"))
    assert "| 32x64x1x2x64 | full |" in table and "| 32x64x1x2x64 | lora2 |" in table and "| 100 | 0.50 |" in table


def test_peak_memory_of_a_configuration():
    memory = lora.peak_memory(SETTINGS, 2)
    assert memory["peak_mib"] >= 0 and set(memory) == {"peak_mib", "peak_is_lower_bound"}


@pytest.mark.parametrize("text", ["1x2x3x4", "58", "0x64x1x2x64", "ax64x1x2x64"])
def test_rejects_bad_model_shapes(text):
    with pytest.raises(argparse.ArgumentTypeError):
        lora._shape(text)
