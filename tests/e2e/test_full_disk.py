"""A full disk while the policy is written (issue 32, item 16): the final export and a publication of the
weights end with one `StorageError` naming the directory, and a publication leaves no ``.vN.partial``.

The disk is full for a child process whose file size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) is below
the size of the weights: every write past it fails with EFBIG as a write to a full disk fails with ENOSPC,
in safetensors' Rust writer as in Python's, and no root is needed."""

from __future__ import annotations

import json
import subprocess
import sys

from factories import make_tiny_qwen2

LIMIT = 16 * 1024  # bytes: config.json fits, the weights (about 300 KiB) do not

SCRIPT = """
import json, os, resource, signal, sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from rlcli.callbacks.publish import WeightPublisher
from rlcli.errors import UserError
from rlcli.training.export import export_policy

model_dir, out, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
policy = AutoModelForCausalLM.from_pretrained(model_dir)
state = {f"scorer.policy.{name}": value for name, value in policy.state_dict().items()}
trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(lightning_module_state_dict=lambda: state))
module = SimpleNamespace(policy=policy, scorer=SimpleNamespace(parameters=policy.parameters), trainer=trainer,
                         device=torch.device("cpu"), steps_done=3, documents_seen=12)
tiny = SimpleNamespace(kind="tiny")  # no tokenizer to copy

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
said = {}
try:
    export_policy(module, trainer, out / "export", tiny)
except UserError as err:
    said["export"] = str(err)
publisher = WeightPublisher(out / "weights", url="redis://127.0.0.1:1/0", stream="s", every=1, keep=2, model_cfg=tiny)
try:
    publisher.publish(module, 3)
except UserError as err:
    said["publish"] = str(err)
said["weights"] = sorted(os.listdir(out / "weights")) if (out / "weights").exists() else []
print(json.dumps(said))
"""


def test_a_full_disk_during_the_export_and_the_publication_is_one_message_and_leaves_no_partial(tmp_path):
    """Before the fix safetensors' SafetensorError (not an OSError) escaped with a traceback, and the
    publication left ``.v3.partial`` behind."""
    model = make_tiny_qwen2(tmp_path / "model")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(tmp_path), str(LIMIT)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    said = json.loads(result.stdout.splitlines()[-1])
    assert said == {"export": f"cannot write {tmp_path / 'export'}: File too large",
                    "publish": f"cannot write {tmp_path / 'weights' / '.v3.partial'}: File too large",
                    "weights": []}
