"""The reward worker pool's overhead: seconds per completion of `RewardSet.score_batch` in the training process
(``task.reward_workers=0``) against the pool (one worker, and the default: the cores), for a trivial reward
(``exact_match``) and for ``math_verify``, the three taking turns in one process; and the seconds per step of a
``task=prompts`` run, inline against the pool.

The default run (``task=reverse``) scores in token space without `RewardSet`, so the pool does not touch it;
``task=prompts`` is the run whose speed it can change. Its runs train a tiny random Qwen2 (tests/factories.py)
on generated sums with math_verify, 8 prompts x 8 completions a step, and take turns inline / pool; the time of
a step is the difference of the wall times of a run of ``--steps`` steps and one of 5, divided by the
difference of their steps (so the start-up common to both drops out; metrics.csv has no time column),
after an untimed warm-up run.

    python -m benchmarks.reward_pool [--completions 512] [--rounds 5] [--steps 105] [--runs 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.output import report
from rlcli.rollout.reward_pool import default_workers
from rlcli.rollout.rewards import build_rewards
from rlcli.rollout.tasks import Prompt
from tests.factories import make_arithmetic_dataset, make_tiny_qwen2

SHORT_RUN = 5  # steps of the run whose wall time is subtracted
REWARDS = {"exact_match": [{"name": "exact_match"}], "math_verify": [{"name": "math_verify"}]}


def batch(n: int) -> tuple[list[str], list[Prompt]]:
    """``n`` completions of sums, half of them right, in the words a model might use."""
    rng = random.Random(0)
    completions, prompts = [], []
    for i in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        answer = a + b + (i % 2)
        completions.append(f"{a} plus {b} makes {answer}, so the answer is \\boxed{{{answer}}}")
        prompts.append(Prompt(text=f"{a}+{b}=", ids=(1,), answer=str(a + b)))
    return completions, prompts


def per_completion(reward: str, workers: list[int], completions: list[str], prompts: list[Prompt],
                   rounds: int) -> dict[int, float]:
    """Median seconds per completion of ``reward`` with each number of ``workers`` (0: inline), in turns."""
    sets = {w: build_rewards(REWARDS[reward], workers=w) for w in workers}
    for rewards in sets.values():  # starts the pool and fills math-verify's caches
        rewards.score_batch(completions, prompts)
    seconds: dict[int, list[float]] = {w: [] for w in workers}
    for _ in range(rounds):
        for w, rewards in sets.items():
            started = time.perf_counter()
            rewards.score_batch(completions, prompts)
            seconds[w].append((time.perf_counter() - started) / len(completions))
    for rewards in sets.values():
        if rewards.pool is not None:
            rewards.pool.close()
    return {w: statistics.median(s) for w, s in seconds.items()}


def wall_seconds(argv: list[str], run_dir: Path) -> float:
    """Wall time of ``rlcli ARGV`` (start-up included)."""
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlcli", *argv, f"hydra.run.dir={run_dir}"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def step_seconds(steps: int, runs: int, tmp: Path) -> dict[str, list[float]]:
    """Seconds per step of ``task=prompts`` runs, inline and with the pool in turns, ``runs`` of each: the wall
    time of ``steps`` steps less that of `SHORT_RUN` steps, over the steps between."""
    model = make_tiny_qwen2(tmp / "model")
    data = make_arithmetic_dataset(tmp / "train.jsonl", 200, seed=1)
    common = ["train", "model=hf", f"model.path={model}", "task=prompts", f"task.paths=[{data}]",
              "rollout.filter=none", "rollout.max_new_tokens=16", "logger=none"]
    seconds: dict[str, list[float]] = {"inline": [], "pool": []}
    wall_seconds([*common, f"trainer.max_steps={SHORT_RUN}"], tmp / "warm-up")  # the first run is slower
    for run in range(runs):
        for name, workers in (("inline", 0), ("pool", "null")):
            wall = {n: wall_seconds([*common, f"trainer.max_steps={n}", f"task.reward_workers={workers}"],
                                    tmp / f"{name}-{run}-{n}") for n in (SHORT_RUN, steps)}
            seconds[name].append((wall[steps] - wall[SHORT_RUN]) / (steps - SHORT_RUN))
    return seconds


def format_table(r: dict) -> str:
    lines = [f"reward pool: {r['completions']} completions a batch, median of {r['rounds']} rounds, "
             f"{r['default_workers']} workers by default"]
    for reward, by_workers in r["per_completion_us"].items():
        inline = by_workers["0"]
        for workers, us in by_workers.items():
            label = "inline (reward_workers=0)" if workers == "0" else f"pool, {workers} worker(s)"
            lines.append(f"  {reward:12s} {label:26s} {us:9.1f} µs/completion  ({us - inline:+9.1f} µs)")
    steps = r["step_s"]
    if not r["steps"]:
        return "\n".join(lines)
    lines.append(f"task=prompts step ({r['steps']}-step run less a {SHORT_RUN}-step one, {r['runs']} each), s/step: "
                 f"inline {', '.join(f'{s:.2f}' for s in steps['inline'])}; "
                 f"pool {', '.join(f'{s:.2f}' for s in steps['pool'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reward_pool", description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=512, help="completions a batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=105,
                        help=f"steps of the long task=prompts runs, more than {SHORT_RUN} (0: no runs)")
    parser.add_argument("--runs", type=int, default=2, help="task=prompts runs of each kind")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    completions, prompts = batch(args.completions)
    workers = list(dict.fromkeys([0, 1, default_workers()]))
    per = {reward: {str(w): s * 1e6 for w, s in per_completion(reward, workers, completions, prompts,
                                                                 args.rounds).items()}
           for reward in REWARDS}
    with tempfile.TemporaryDirectory() as tmp:
        steps = step_seconds(args.steps, args.runs, Path(tmp)) if args.steps else {"inline": [], "pool": []}
    result = {"completions": args.completions, "rounds": args.rounds, "default_workers": default_workers(),
              "per_completion_us": per, "steps": args.steps, "runs": args.runs, "step_s": steps}
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
