"""A signal stops `rlcli train` within seconds while a step's reward hangs (issue 32, item 14): inline
(``task.reward_workers=0``, the reward in the training process's main thread) and with the pool (the main
thread waiting on a worker's call that would run for an hour). The step is abandoned, the run exits with
the signal's code and says so in one line, no traceback, and no process of it (a reward worker, the fork
server) is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from factories import make_arithmetic_dataset, make_tiny_qwen2
from train_helpers import alive, descendants

PROMPT = ["rollout.filter=none", "rollout.max_new_tokens=2", "rollout.prompts_per_step=1", "rollout.group_size=2",
          "trainer.max_steps=3", "logger=none", "hydra.run.dir=run", "allow_targets=[hanging]",
          "task.rewards=[{_target_: hanging.hangs}]"]
STOPPED_WITHIN = 30.0  # seconds from the signal to the run's end: the reward alone would take an hour


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")
@pytest.mark.parametrize("pool, send", [
    ("task.reward_workers=0", "SIGTERM"),
    ("task.reward_workers=0", "SIGINT twice"),  # Ctrl-C, twice, to the terminal's process group
    ("task.reward_workers=1", "SIGTERM"),
])
def test_a_signal_stops_a_run_whose_reward_hangs(tmp_path, pool, send):
    """Before the fix every one of these signals was noted ("stopping after this step") and the run went on
    waiting for the reward: the wait below timed out."""
    model = make_tiny_qwen2(tmp_path / "model")
    train = make_arithmetic_dataset(tmp_path / "train.jsonl", 8, seed=1)
    scoring = tmp_path / "scoring"
    (tmp_path / "hanging.py").write_text(textwrap.dedent(f"""
        import pathlib, time

        def hangs(completion):
            pathlib.Path({str(scoring)!r}).touch()
            time.sleep(3600)
    """))
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(tmp_path))
    output = tmp_path / "output.txt"
    with output.open("w") as out:
        run = subprocess.Popen([sys.executable, "-m", "rlcli", "train", "model=hf", f"model.path={model}",
                                "task=prompts", f"task.paths=[{train}]", "task.reward_timeout=3600", pool, *PROMPT],
                               cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not scoring.exists():
            assert run.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)  # well inside the reward's sleep
        processes = descendants(run.pid) | {run.pid}
        signalled = time.monotonic()
        if send == "SIGTERM":
            os.kill(run.pid, signal.SIGTERM)
        else:
            os.killpg(run.pid, signal.SIGINT)
            time.sleep(0.2)
            os.killpg(run.pid, signal.SIGINT)
        run.wait(timeout=STOPPED_WITHIN)
        stopped_after = time.monotonic() - signalled
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    text = output.read_text()
    assert run.returncode == (143 if send == "SIGTERM" else 130), text[-3000:]
    assert stopped_after < STOPPED_WITHIN
    assert "Traceback" not in text, text[-3000:]
    name = send.split()[0]
    assert f"{name}: the rewards of step 1 did not end, so the step was abandoned and is not saved; resume=auto " \
           "continues from the last checkpoint" in text, text[-3000:]
    deadline = time.monotonic() + 10
    while (left := [pid for pid in processes if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left
    assert not (tmp_path / "run" / "checkpoints").exists()
