"""Every column of the metrics.csv of a `data=stream` run is declared (the live loop's part of
tests/e2e/test_metrics_declared.py): a trainer on a real Redis trains three pushed records with rewards,
publishing its weights. Fails naming the undeclared columns, or the live loop's columns the run did not write."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from factories import rollout_record
from rlcli.commands.train import train
from rlcli.stream import StreamWriter
from train_helpers import compose_train_config

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tools/ is not installed

from tools.docgen.metrics import declared, matches  # noqa: E402


def test_every_column_of_a_stream_run_is_declared(redis_url, tmp_path):
    with StreamWriter(redis_url) as writer:
        writer.push_many([rollout_record(i, vocab=7, advantage=1.0 - i, id=f"r{i}", policy_version=0)
                          for i in range(3)])
    train(compose_train_config(["data=stream", f"data.url={redis_url}", "data.idle_timeout=1", "data.max_tokens=10",
                                "logger=none", "trainer.accumulate_microbatches=1", "trainer.max_steps=3"]), tmp_path)
    with (tmp_path / "metrics.csv").open() as f:
        found = set(next(csv.reader(f))) - {"step"}
    names = [name for name, _ in declared()]
    assert sorted(c for c in found if not any(matches(name, c) for name in names)) == []
    assert {"staleness_mean", "staleness_max", "stale_dropped", "queue_depth", "wait_time", "weight_publish_time",
            "reward"} <= found
