"""The reward worker pool (`rlcli.rollout.reward_pool`), real processes with short timeouts: a reward that
hangs, kills its worker or raises SystemExit, or returns a string scores 0 with its reason counted, and the
next batch scores right on replaced workers; batched and async functions; values in the completions' order;
no worker left after `close` or after the training process is killed with SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlcli.errors import UserError
from rlcli.rollout.reward_pool import default_workers
from rlcli.rollout.rewards import build_rewards
from rlcli.rollout.tasks import Prompt
from train_helpers import alive, descendants

TIMEOUT = 0.5


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``pool_rewards`` in ``tmp_path``, importable through ``sys.path`` alone (as the workers get it)."""
    (tmp_path / "pool_rewards.py").write_text(textwrap.dedent("""
        import asyncio, os, signal, time

        def hangs(completion):
            time.sleep(3600)

        def exits(completion):
            os._exit(3)

        def segfaults(completion):
            os.kill(os.getpid(), signal.SIGSEGV)

        def says_one(completion):
            return "1.0"

        def quits(completion):
            raise SystemExit(4)

        def length(completion):
            return float(len(completion))

        def slower_first(completion, *, answer):
            time.sleep(0.3 / int(answer))  # the first completion ends last
            return float(answer)

        def batch_total(completions, *, answer):
            total = sum(len(c) for c in completions)
            return [total + int(a) for a in answer]

        async def async_length(completion, *, answer):
            await asyncio.sleep(0.01)
            return len(completion) * 10 + int(answer)

        async def async_batch(completions):
            await asyncio.sleep(0.01)
            return [-len(c) for c in completions]

        def pid(completion, *, pid_dir):
            open(os.path.join(pid_dir, str(os.getpid())), "w").close()
            return 1.0

        def pid_then_hang(completion, *, pid_dir):
            pid(completion, pid_dir=pid_dir)
            time.sleep(3600)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "pool_rewards"
    sys.modules.pop("pool_rewards", None)


def prompts(*answers):
    return [Prompt(text="Q", ids=(1,), answer=str(a)) for a in answers]


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_hang_a_crash_a_string_and_systemexit_score_zero_and_the_next_batch_scores(user_module, caplog):
    """Each failing term scores 0 on every completion with its own reason, the good term keeps its value; the
    second batch scores the same, so dead and hung workers were replaced (a pool that lost them hangs or
    fails every call of batch 2). Inline, `hangs` would never return and `quits` would end pytest."""
    failing = ["hangs", "exits", "segfaults", "says_one", "quits"]
    rewards = build_rewards([{"_target_": f"{user_module}.{name}"} for name in failing]
                            + [{"_target_": f"{user_module}.length"}], workers=2, timeout=TIMEOUT)
    completions = ["a", "bbb"]
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="rlcli"):
            caplog.clear()
            scores = rewards.score_batch(completions, prompts(1, 2))
            stats = rewards.take_stats()
        assert [s.terms for s in scores] == [{**dict.fromkeys(failing, 0.0), "length": float(len(c))}
                                             for c in completions]
        assert [s.reward for s in scores] == [1.0, 3.0]
        assert stats["reward_errors"] == len(failing) * len(completions)
        logged = {name: m for m in caplog.messages for name in failing if m.startswith(f"reward {name} failed")}
        assert logged.keys() == set(failing)
        assert f"timed out after {TIMEOUT:g} s" in logged["hangs"]
        assert "exit code 3" in logged["exits"]
        assert "killed by SIGSEGV" in logged["segfaults"]
        assert "returned '1.0', not a number" in logged["says_one"]
        assert "SystemExit: 4" in logged["quits"]


def test_batched_and_async_functions_in_the_pool(user_module):
    """Hand-derived: batch_total = total length 1+2+3 = 6 plus the answer; async_length = 10 * length +
    answer; async_batch = -length. A batched function called per completion would see totals 1, 2, 3; an
    async one not awaited returns a coroutine, a failure scoring 0."""
    rewards = build_rewards([{"_target_": f"{user_module}.batch_total", "batched": True},
                             {"_target_": f"{user_module}.async_length"},
                             {"_target_": f"{user_module}.async_batch", "batched": True}], workers=2, timeout=5)
    scores = rewards.score_batch(["a", "bb", "ccc"], prompts(1, 2, 3))
    assert [s.terms for s in scores] == [
        {"batch_total": 7.0, "async_length": 11.0, "async_batch": -1.0},
        {"batch_total": 8.0, "async_length": 22.0, "async_batch": -2.0},
        {"batch_total": 9.0, "async_length": 33.0, "async_batch": -3.0},
    ]
    assert rewards.take_stats()["reward_errors"] == 0.0


def test_async_functions_run_inline_too(user_module):
    rewards = build_rewards([{"_target_": f"{user_module}.async_length"}])
    assert [s.reward for s in rewards.score_batch(["ab", "c"], prompts(5, 6))] == [25.0, 16.0]


def test_values_come_back_in_the_completions_order(user_module):
    """The first completion's call ends last (it sleeps 0.3 s, the fourth 0.075 s) on 3 workers: values
    gathered as calls end would come back reversed."""
    rewards = build_rewards([{"_target_": f"{user_module}.slower_first"}], workers=3, timeout=5)
    scores = rewards.score_batch(["w", "x", "y", "z"], prompts(1, 2, 3, 4))
    assert [s.reward for s in scores] == [1.0, 2.0, 3.0, 4.0]


def test_no_worker_is_left_after_close(user_module, tmp_path):
    """Each worker writes its pid; after `close` none of them is alive (pebble stops them)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    rewards = build_rewards([{"_target_": f"{user_module}.pid", "pid_dir": str(pid_dir)}], workers=2, timeout=5)
    assert [s.reward for s in rewards.score_batch(["a"] * 6, prompts(*range(6)))] == [1.0] * 6
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert pids and all(alive(pid) for pid in pids)
    rewards.pool.close()
    assert wait_for(lambda: not any(alive(pid) for pid in pids), 10), [p for p in pids if alive(p)]


def test_no_worker_outlives_a_training_process_killed_with_sigkill(user_module, tmp_path):
    """A process scoring with workers that hang in a call is killed with SIGKILL (no exit handler runs):
    its workers (mid-call), the fork server and every other process it started end within seconds. Without
    the workers' watch on their parent, the hanging ones would sleep on for an hour."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        from rlcli.rollout.rewards import build_rewards
        from rlcli.rollout.tasks import Prompt

        if __name__ == "__main__":
            rewards = build_rewards([{{"_target_": "{user_module}.pid_then_hang", "pid_dir": {str(pid_dir)!r}}}],
                                    workers=2, timeout=3600)
            rewards.score_batch(["a", "b"], [Prompt(text="Q", ids=(1,), answer="1")] * 2)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    trainer = subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path)
    try:
        assert wait_for(lambda: len(list(pid_dir.iterdir())) == 2, 60), "the workers never started their calls"
        workers = {int(p.name) for p in pid_dir.iterdir()}
        started = descendants(trainer.pid)
        assert workers <= started
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        assert wait_for(lambda: not any(alive(pid) for pid in started), 10), [p for p in started if alive(p)]
    finally:
        trainer.kill()


def test_workers_that_cannot_build_the_terms_fail_the_batch_and_a_new_pool_tries_again(user_module, tmp_path,
                                                                                     monkeypatch, caplog):
    """The module is importable when the terms are built, not when the workers start: every call scores 0
    with the reason, promptly (no hang on a pool without workers), batch after batch; once the module is
    back, a new pool scores again (a pool left broken would fail every later batch)."""
    rewards = build_rewards([{"_target_": f"{user_module}.length"}], workers=2, timeout=5)
    path = list(sys.path)
    monkeypatch.setattr(sys, "path", [p for p in path if p != str(tmp_path)])  # the workers get this sys.path
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="rlcli"):
            caplog.clear()
            assert [s.reward for s in rewards.score_batch(["ab", "c"], prompts(1, 2))] == [0.0, 0.0]
            assert rewards.take_stats()["reward_errors"] == 2
        assert "no reward worker could run it" in caplog.text
    monkeypatch.setattr(sys, "path", path)
    assert [s.reward for s in rewards.score_batch(["ab", "c"], prompts(1, 2))] == [2.0, 1.0]


@pytest.mark.parametrize(("env", "processes"), [({}, 1), ({"WORLD_SIZE": "2"}, 2),
                                                 ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, 4)])
def test_the_default_workers_share_the_cores_among_the_nodes_training_processes(env, processes, monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE first, else Lightning's WORLD_SIZE; at least one worker."""
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cores = len(os.sched_getaffinity(0))
    assert default_workers() == max(1, cores // processes)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
    assert default_workers() == 1


@pytest.mark.parametrize(("workers", "timeout", "message"), [
    (-1, 10.0, "task.reward_workers: must be an integer >= 0"),
    (True, 10.0, "task.reward_workers: must be an integer >= 0"),
    (2, 0, "task.reward_timeout: must be a number of seconds > 0"),
    (2, float("nan"), "task.reward_timeout: must be a number of seconds > 0"),
    (2, "5", "task.reward_timeout: must be a number of seconds > 0"),
])
def test_bad_pool_settings_are_user_errors(workers, timeout, message):
    with pytest.raises(UserError, match=f"^{message}"):
        build_rewards([{"name": "regex", "pattern": "a"}], workers=workers, timeout=timeout)
