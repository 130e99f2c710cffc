"""The cost of dynamic sampling on the default task: sampling rounds per step and seconds per step of
``rlcli train rollout.filter=zero_variance`` (judged on the task's reward, the default for the reverse task,
and on accuracy) against a plain run.

Each run is ``rlcli train`` on the default task (``data=generate``, 8 prompts x 8 completions a step) with the
same seed, ``trainer.max_bad_steps`` as large as the run; a run that nonetheless meets that many all-filtered
batches in a row stops there, and the results say so (``stopped``).
From ``metrics.csv``: the mean ``sampling_rounds`` a step, the groups sampled a step (kept + filtered; 8 without
the filter), the batches that needed more than one round, the empty steps (a batch that kept no group trains
nothing, so a run of N steps may read more than N batches); from the rows' timestamps, the mean seconds a batch
(the start-up left out), and its ratio to the plain run's.

    python -m benchmarks.dynamic_sampling [--steps 100] [--runs RUN ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.live_loop import timed_rows
from benchmarks.output import report

PROMPTS_PER_STEP = 8  # the default rollout.prompts_per_step
BAD_STEPS_STOP = "steps in a row kept no document"  # rlcli's error at trainer.max_bad_steps filtered batches
RUNS = {
    "plain": [],
    "zero_variance (reward)": ["rollout.filter=zero_variance"],
    "zero_variance (accuracy)": ["rollout.filter=zero_variance", "rollout.filter_metric=accuracy"],
}


def summary(name: str, rows: list[tuple[float, dict]], total: float, stopped: str | None) -> dict:
    times = [t for t, _ in rows]
    metrics = [row for _, row in rows]

    def mean(key: str, default: float) -> float:
        return statistics.fmean(float(row[key]) if row.get(key) else default for row in metrics)

    rounds = [float(row["sampling_rounds"]) if row.get("sampling_rounds") else 1.0 for row in metrics]
    return {
        "name": name, "batches": len(rows), "stopped": stopped, "wall_s": total,
        "batch_s": (times[-1] - times[0]) / (len(rows) - 1) if len(rows) > 1 else None,
        "sampling_rounds": statistics.fmean(rounds),
        "max_sampling_rounds": max(rounds),
        "batches_with_more_rounds": sum(r > 1 for r in rounds),
        "groups_sampled": mean("groups_kept", PROMPTS_PER_STEP) + mean("groups_filtered", 0.0),
        "groups_kept": mean("groups_kept", PROMPTS_PER_STEP),
        "empty_steps": float(metrics[-1].get("empty_steps") or 0.0),
        "final_reward": statistics.fmean(float(row["reward"]) for row in metrics[-10:]),
    }


def format_table(r: dict) -> str:
    plain = r["runs"][0]["batch_s"]
    lines = [
        f"{r['steps']} training steps of the default task (reverse, 8 prompts x 8 completions a batch, seed 0), CPU",
        "",
        "| run | batches (empty) | rounds a batch (mean, max) | batches with > 1 round | groups sampled a batch "
        "| groups kept a batch | s a batch (mean) | ratio to plain | reward (last 10) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in r["runs"]:
        ratio = run["batch_s"] / plain if run["batch_s"] and plain else float("nan")
        lines.append(
            f"| {run['name']} | {run['batches']} ({run['empty_steps']:.0f}) | {run['sampling_rounds']:.2f}, "
            f"{run['max_sampling_rounds']:.0f} | {run['batches_with_more_rounds']} | {run['groups_sampled']:.2f} "
            f"| {run['groups_kept']:.2f} | {run['batch_s']:.3f} | {ratio:.2f} | {run['final_reward']:.3f} |")
    lines += [f"\n{run['name']} stopped after {run['batches']} batches: {run['stopped']}"
              for run in r["runs"] if run["stopped"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dynamic_sampling", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), metavar="RUN",
                        help=f"the runs to make, the first is the others' baseline: {', '.join(map(repr, RUNS))}")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    common = ["train", f"trainer.max_steps={args.steps}", f"trainer.max_bad_steps={args.steps}", "logger=none"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.runs):
            rows, total, stopped = timed_rows([*common, *RUNS[name]], Path(tmp) / str(i), stop=BAD_STEPS_STOP)
            runs.append(summary(name, rows, total, stopped))
    result = {"steps": args.steps, "runs": runs}
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
