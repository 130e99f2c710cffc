"""Smoke test of the issue-8 benchmarks at tiny sizes (the real run is ``python -m benchmarks``)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import live_loop, lm_head, stream_queue, throughput


def test_lm_head_matrix_compares_naive_and_chunked(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lm_head, "_run_in_subprocess", lm_head._worker)  # in-process: fast
    out = tmp_path / "head.json"
    lm_head.main(["--sizes", "32x8x40", "--losses", "grpo", "gspo", "--entropy", "both", "--chunk-tokens", "8",
                  "--repeats", "5", "--warmup", "1", "--threads", "1", "--doc-tokens", "8", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert len(saved["results"]) == 8 and len(saved["comparison"]) == 4
    for row in saved["comparison"]:
        assert row["rlcli_s"] > 0 and row["naive_s"] > 0 and row["floor_s"] > 0
    for naive, chunked, row in zip(saved["results"][::2], saved["results"][1::2], saved["comparison"]):
        assert naive["chunk_tokens"] == "naive"
        assert abs(naive["loss"] - chunked["loss"]) <= 1e-5 * (1 + abs(naive["loss"]))
        # the time ratio pairs the runs of each round
        paired = sorted(c / n for c, n in zip(chunked["times_s"], naive["times_s"]))
        assert row["time_ratio"] == paired[2]
    table = capsys.readouterr().out
    assert "time ratio" in table and "GFLOP/s" in table and "gspo" in table


def test_throughput_runs_both_loops(tmp_path):
    out = tmp_path / "tp.json"
    r = throughput.main(["--documents", "6", "--min-completion", "2", "--max-completion", "8", "--max-tokens", "32",
                         "--hidden", "16", "--vocab", "64", "--chunk-tokens", "8", "--repeats", "1", "--threads", "1",
                         "--json", str(out)])
    assert r["packed_tokens_per_s"] > 0 and r["padded_tokens_per_s"] > 0
    assert json.loads(out.read_text())["real_tokens"] == r["real_tokens"]


def test_loss_terms_times_the_four_steps(tmp_path, capsys):
    from benchmarks import loss_terms

    threads = torch.get_num_threads()
    out = tmp_path / "terms.json"
    r = loss_terms.main(["--documents", "6", "--min-completion", "2", "--max-completion", "8", "--max-tokens", "32",
                         "--hidden", "16", "--vocab", "64", "--chunk-tokens", "8", "--repeats", "1",
                         "--json", str(out), "--cpu-time"])
    assert r["plain_s"] > 0 and r["recompute_ratio"] > 0 and r["kl_ratio"] > 0 and r["distill_ratio"] > 0
    assert r["timer"] == "CPU time, one thread" and torch.get_num_threads() == threads  # restored
    assert json.loads(out.read_text())["micro_batches"] == r["micro_batches"]
    printed = capsys.readouterr().out
    assert "+ KL" in printed and "+ distill" in printed


def test_peak_memory_sees_the_naive_logits_and_not_the_fused_chunks():
    # each configuration in its own process, as `python -m benchmarks` runs it: the measured peak of the
    # naive path holds the full logits and log-softmax, the fused path's one chunk of them
    n, h, v, chunk = 1024, 16, 16000, 16
    logits_mib = n * v * 4 / 2**20  # one float32 [N, V] tensor: 62.5 MiB
    base = dict(tokens=n, hidden=h, vocab=v, repeats=1, warmup=0, dtype="float32", threads=1, doc_tokens=64,
                loss="grpo", entropy=False, device="cpu", mode="memory")
    (naive,) = lm_head._run_in_subprocess(base | {"chunks": [lm_head.NAIVE]})
    (fused,) = lm_head._run_in_subprocess(base | {"chunks": [chunk]})
    assert not naive["peak_is_lower_bound"] and not fused["peak_is_lower_bound"]
    assert naive["peak_extra_mib"] >= 2 * logits_mib
    assert fused["peak_extra_mib"] <= 0.25 * logits_mib
    assert abs(naive["loss"] - fused["loss"]) <= 1e-5 * (1 + abs(naive["loss"]))


def test_stream_queue_reads_every_pushed_record_back(tmp_path):
    out = tmp_path / "queue.json"
    r = stream_queue.main(["--records", "40", "--prompt", "4", "--completion", "8", "--rounds", "1",
                           "--json", str(out)])
    assert r["records"] == 40 and r["push_us_per_record"] > 0 and r["stream_read_us_per_record"] > 0
    assert json.loads(out.read_text())["file_read_us_per_record"] > 0


@pytest.mark.slow
def test_live_loop_times_the_synchronous_run_and_the_loop(tmp_path):
    r = live_loop.main(["--steps", "2", "--samplers", "1", "--json", str(tmp_path / "loop.json")])
    assert [run["steps"] for run in r["runs"]] == [2, 2]  # 2 steps: the fewest that give a rate
    assert all(run["steps_per_min"] > 0 and run["wall_s"] >= run["first_step_s"] > 0 for run in r["runs"])
