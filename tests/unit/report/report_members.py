"""Member directories as `rlcli train -m` leaves them, for the report's tests."""

import csv
import json
from pathlib import Path


def write_member(path: Path, overrides: list[str], columns: dict[str, list[float]], objective: dict | None = None):
    """A member directory as `rlcli train -m` leaves it: overrides, metrics.csv, export/, objective.json."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    with (path / "metrics.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(zip(*columns.values()))
    (path / "export").mkdir()
    if objective is not None:
        (path / "objective.json").write_text(json.dumps(objective))


def on_policy(reward: list[float], loss: list[float]) -> dict[str, list[float]]:
    """metrics.csv columns of an on-policy run: ratio 1 and nothing clipped."""
    steps = len(reward)
    return {"step": list(range(1, steps + 1)), "loss": loss, "reward": reward, "ratio_new_old": [1.0] * steps,
            "clipped_ratio_fraction": [0.0] * steps}
