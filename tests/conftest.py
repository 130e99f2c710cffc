"""Fixtures for the tests of `rlcli train`."""

from __future__ import annotations

from pathlib import Path

import pytest

from factories import rollout_record, write_jsonl


@pytest.fixture
def small_rollouts(tmp_path: Path) -> Path:
    """16 valid documents in 4 groups, of different lengths."""
    records = [rollout_record(g, prompt_len=2 + g % 3, completion_len=3 + g % 5) for g in range(16)]
    return write_jsonl(tmp_path / "rollouts.jsonl", records)
