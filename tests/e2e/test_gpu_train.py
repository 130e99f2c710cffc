"""`rlcli train` on a GPU: `strategy=fsdp` (Lightning's FSDPStrategy, GPU only) trains exactly as one
plain process does, and exports a model that reloads. Runs only where a CUDA device is (see
docs/performance.md for where it was run); CI machines have none."""

from __future__ import annotations

import pytest
import torch
from test_train import read_metrics, train_in_process

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_fsdp_on_one_gpu_equals_a_plain_run(tmp_path, small_rollouts):
    runs = {}
    for strategy in ("auto", "fsdp"):
        _, run_dir = train_in_process(tmp_path / strategy, small_rollouts, f"strategy={strategy}",
                                      "trainer.accelerator=gpu", "logger=none", steps=3)
        runs[strategy] = read_metrics(run_dir)
        assert (run_dir / "export" / "model.safetensors").is_file()
    assert len(runs["fsdp"]) == len(runs["auto"]) == 3
    for plain, sharded in zip(runs["auto"], runs["fsdp"]):
        for name in ("loss", "grad_norm", "num_tokens", "ratio_new_old"):
            assert float(sharded[name]) == pytest.approx(float(plain[name]), rel=1e-4, abs=1e-6), name
