"""Helpers for the tests of `rlcli train`: compose configs in-process, run the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def require_vllm() -> None:
    """Skip the calling test where vLLM cannot be imported, except in CI, which installs it (`make setup-vllm`)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("vLLM cannot be imported, though CI installs it with `make setup-vllm`")
        pytest.skip("vLLM is not installed here: `make setup-vllm` installs it into .venv")


def compose_train_config(overrides: list[str] = ()):
    """The composed (unvalidated) `rlcli train` config, as Hydra builds it from the package."""
    with initialize_config_module(config_module="rlcli.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def straight_and_resumed(common: list[str], root: Path) -> tuple[Path, Path]:
    """The run directories of two `rlcli train` runs of ``common`` (4 steps, a checkpoint every 2): one straight
    through, and one whose step-4 checkpoint is lost (as if killed after step 4's outputs were written) and that
    resumes from step 2."""
    from rlcli.commands.train import train

    straight, resumed = root / "straight", root / "resumed"
    train(compose_train_config(common), straight)
    train(compose_train_config(common), resumed)
    (resumed / "checkpoints" / "step-4.ckpt").unlink()
    train(compose_train_config([*common, "resume=auto"]), resumed)
    return straight, resumed


def run_rlcli(
    args: list[str], cwd: Path, timeout: float = 600, wandb_mode: str = "disabled", extra_env: dict | None = None,
    preexec_fn=None,
) -> subprocess.CompletedProcess:
    """``python -m rlcli ARGS`` in ``cwd``, output captured; wandb never goes online. ``preexec_fn`` runs in
    the child before it starts (e.g. to set a resource limit)."""
    env = dict(os.environ, WANDB_MODE=wandb_mode, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "rlcli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` in the process tree."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class EchoTask:
    """A custom task for the plug-in test: the reward is 1 when the completion starts with the
    prompt's first character (a two-letter alphabet, so random sampling gets it half the time)."""

    def __init__(self, letters: str = "ab") -> None:
        from rlcli.rollout.tasks import CharTokenizer

        self.letters = letters
        self.tokenizer = CharTokenizer(letters)

    def sample_prompts(self, rng, n):
        from rlcli.rollout.tasks import Prompt

        texts = [rng.choice(self.letters) for _ in range(n)]
        return [Prompt(text=t, ids=tuple(self.tokenizer.encode(t)), answer=t) for t in texts]

    def reward(self, prompt, completion_ids):
        return float(list(completion_ids[:1]) == self.tokenizer.encode(prompt.answer))

    def is_correct(self, prompt, completion_ids):
        return self.reward(prompt, completion_ids) == 1.0
