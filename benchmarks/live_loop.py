"""The live loop against synchronous on-policy training, on the default task: steps per minute and
the time to reach the reward of the default run.

Runs ``rlcli train`` (``data=generate``: the trainer samples each step itself) and ``rlcli loop``
with 1 and 2 samplers, each for the same number of steps of the same size (the loop's trainer takes
exactly ``trainer.docs_per_step`` = one sampler round, 8 prompts x 8 completions, per step), timestamping
every ``metrics.csv`` row as it appears. The target reward is the synchronous run's mean over its
last 10 steps; a run reaches it at the first step where the mean reward of the last 5 steps is at
least that.

    python -m benchmarks.live_loop [--steps 60] [--samplers 1 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.output import report

TARGET_WINDOW, SMOOTHING = 10, 5
DOCS_PER_STEP = 64  # what a synchronous step of the default run trains: rollout.prompts_per_step x group_size


def timed_rows(argv: list[str], run_dir: Path, stop: str | None = None
               ) -> tuple[list[tuple[float, dict]], float, str | None]:
    """``[(seconds since start, row)]`` of the run's metrics.csv, its total wall time, and how it stopped: None
    when it finished; a run that fails raises `SystemExit`, unless its error names ``stop`` (an end the caller
    expects) after it logged a step: then the error's last line."""
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "rlcli", *argv, f"hydra.run.dir={run_dir}"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    while True:
        done = process.poll() is not None
        path = run_dir / "metrics.csv"
        if path.is_file():
            with path.open() as f:
                for row in csv.DictReader(f):
                    seen.setdefault(row["step"], time.perf_counter() - started)
        if done:
            break
        time.sleep(0.1)
    total = time.perf_counter() - started
    stopped = None
    if process.returncode != 0:
        error = process.stderr.read()[-3000:]
        if stop is None or stop not in error or not (run_dir / "metrics.csv").is_file():
            raise SystemExit(f"{' '.join(argv)} failed ({process.returncode}):\n{error}")
        stopped = error.strip().splitlines()[-1]
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    return [(seen[row["step"]], row) for row in rows], total, stopped


def summary(name: str, rows: list[tuple[float, dict]], total: float, target: float | None) -> dict:
    rewards = [float(row["reward"]) for _, row in rows]
    first, last = rows[0][0], rows[-1][0]
    reached = None
    if target is not None:
        for i in range(SMOOTHING - 1, len(rows)):
            if sum(rewards[i - SMOOTHING + 1:i + 1]) / SMOOTHING >= target:
                reached = rows[i][0]
                break
    return {
        "name": name, "steps": len(rows), "wall_s": total,
        "steps_per_min": 60 * (len(rows) - 1) / (last - first) if len(rows) > 1 and last > first else None,
        "first_step_s": first, "final_reward": sum(rewards[-TARGET_WINDOW:]) / len(rewards[-TARGET_WINDOW:]),
        "time_to_target_s": reached,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.live_loop", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samplers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    common = [f"trainer.max_steps={args.steps}", "logger=none"]
    with tempfile.TemporaryDirectory() as tmp:
        rows, total, _ = timed_rows(["train", *common], Path(tmp) / "sync")
        target = sum(float(r["reward"]) for _, r in rows[-TARGET_WINDOW:]) / min(TARGET_WINDOW, len(rows))
        results = [summary("train data=generate (synchronous)", rows, total, target)]
        for n in args.samplers:
            rows, total, _ = timed_rows(["loop", f"sample.workers={n}", f"trainer.docs_per_step={DOCS_PER_STEP}",
                                         "trainer.docs_per_step_mode=exact", *common], Path(tmp) / f"loop{n}")
            results.append(summary(f"loop sample.workers={n}", rows, total, target))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"live loop vs synchronous, {args.steps} steps, target reward {target:.3f} "
             f"(synchronous mean of its last {TARGET_WINDOW} steps; reached by a {SMOOTHING}-step mean)",
             f"{'run':36} {'wall s':>7} {'1st step s':>10} {'steps/min':>9} {'final reward':>12} {'to target s':>11}"]
    for r in results:
        lines.append(f"{r['name']:36} {r['wall_s']:7.1f} {r['first_step_s']:10.1f} {fmt(r['steps_per_min'], '9.1f')} "
                     f"{r['final_reward']:12.3f} {fmt(r['time_to_target_s'], '11.1f')}")
    return report({"target_reward": target, "runs": results}, "\n".join(lines), args.json)


if __name__ == "__main__":
    main()
