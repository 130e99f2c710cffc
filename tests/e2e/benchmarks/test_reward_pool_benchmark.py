"""Smoke test of the reward pool benchmark at a tiny size (the real run is ``python -m benchmarks reward_pool``)."""

from __future__ import annotations

import json

from benchmarks import reward_pool


def test_reward_pool_times_inline_and_pooled_rewards(tmp_path, capsys):
    out = tmp_path / "pool.json"
    r = reward_pool.main(["--completions", "8", "--rounds", "1", "--steps", "0", "--json", str(out)])
    workers = {"0", "1", str(r["default_workers"])}
    for reward in ("exact_match", "math_verify"):
        assert r["per_completion_us"][reward].keys() == workers
        assert all(us > 0 for us in r["per_completion_us"][reward].values())
    assert json.loads(out.read_text())["completions"] == 8
    assert "math_verify" in capsys.readouterr().out
