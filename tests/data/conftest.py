"""Shared helpers for the rollout data tests: a valid record and writers for JSONL and Parquet."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def valid_record(drop=(), **overrides):
    """A record that passes every rule with a vocabulary of 50, with fields overridden or dropped."""
    record = {
        "prompt_ids": [1, 2, 3],
        "completion_ids": [4, 5],
        "old_logprobs": [-0.5, -1.0],
        "reward": 1.0,
        "group_id": "g0",
    }
    record.update(overrides)
    return {k: v for k, v in record.items() if k not in drop}


@pytest.fixture
def record():
    return valid_record


@pytest.fixture
def write_jsonl():
    def write(path: Path, records) -> Path:
        """Write records (dicts, or raw strings written as they are) one per line."""
        lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    return write


@pytest.fixture
def write_parquet():
    def write(path: Path, records, row_group_size=None) -> Path:
        """Write records as rows; a field missing from a row is null there."""
        names = list(dict.fromkeys(name for r in records for name in r))
        columns = {name: [r.get(name) for r in records] for name in names}
        pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
        return path

    return write
