"""Fixtures of the rollout data tests: a small valid record and the writers of JSONL and Parquet files."""

import pytest

from factories import rollout_record, write_jsonl, write_parquet

SMALL = dict(prompt_ids=[1, 2, 3], completion_ids=[4, 5], old_logprobs=[-0.5, -1.0], reward=1.0, group_id="g0")


@pytest.fixture
def record():
    """``record(drop=(), **fields)``: a record that passes every rule with a vocabulary of 50, with fields
    replaced, added or dropped."""
    return lambda drop=(), **fields: rollout_record(drop=drop, **(SMALL | fields))


@pytest.fixture(name="write_jsonl")
def jsonl_writer():
    return write_jsonl


@pytest.fixture(name="write_parquet")
def parquet_writer():
    return write_parquet
