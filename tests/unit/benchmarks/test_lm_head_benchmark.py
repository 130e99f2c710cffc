"""Smoke test of ``benchmarks/lm_head.py`` at a tiny size (the real run is by hand, see its docstring)."""

from __future__ import annotations

import json

import pytest

from benchmarks import lm_head

TINY = dict(tokens=48, hidden=8, vocab=64, repeats=5, warmup=1, dtype="float32", threads=1, doc_tokens=12)


def test_worker_times_every_path_in_turns_and_they_agree():
    chunks = [lm_head.NAIVE, 0, 5, "auto"]
    results = lm_head._worker(TINY | {"mode": "time", "chunks": chunks})
    assert [r["chunk_tokens"] for r in results] == chunks
    for r in results:
        assert len(r["times_s"]) == 5 and all(t > 0 for t in r["times_s"])
        assert r["min_s"] <= r["median_s"]
    losses = [r["loss"] for r in results]
    assert losses == pytest.approx([losses[0]] * 4, rel=1e-5)
    assert results[3]["chunk_tokens_used"] == 2**24 // 64  # more than the 48 tokens: one chunk
    memory = [lm_head._worker(TINY | {"mode": "memory", "chunks": [c]})[0] for c in chunks]
    for r, m in zip(results, memory):
        r |= {k: m[k] for k in lm_head.MEMORY_FIELDS}
        assert m["peak_extra_mib"] >= 0 and m["loss"] == pytest.approx(r["loss"], rel=1e-6)
    table = lm_head.format_table(results, TINY | dict(torch="x", cpu="y"))
    assert "naive" in table and "chunk_tokens=5" in table and "one chunk" in table and "auto (262144)" in table


def test_a_memory_worker_takes_one_configuration():
    with pytest.raises(ValueError):
        lm_head._worker(TINY | {"mode": "memory", "chunks": [lm_head.NAIVE, 5]})


def test_main_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    results = lm_head.main(["--tokens", "32", "--hidden", "8", "--vocab", "50", "--chunk-tokens", "7", "--no-naive",
                            "--threads", "1", "--doc-tokens", "8", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == results and len(results) == 1
    assert results[0]["chunk_tokens"] == 7 and results[0]["peak_extra_mib"] >= 0


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--chunk-tokens", "-1"], ["--chunk-tokens", "all"],
                                  ["--tokens", "0"]])
def test_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit):
        lm_head.main(argv)
