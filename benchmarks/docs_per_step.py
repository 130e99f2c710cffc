"""Per-step cost of `trainer.docs_per_step` (a document-count all-reduce per fetched micro-batch)
against a static step over the same micro-batches, on 2 CPU processes over gloo.

Each process holds its share of synthetic rollouts in a `DocumentStream`. For each mode it runs
the step preparation of the trainer (`collect_batch` + `plan_update`) and, to put the overhead in
scale, the forward and backward of the tiny default model over the step's micro-batches. Both
modes see the same micro-batches: the static step takes `micro_batches` per process, the
document-target step is sized so that it takes the same number.

Usage: ``python -m benchmarks.docs_per_step [--steps 20] [--micro-batches 4] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
DOC_TOKENS = 32
MAX_TOKENS = 128  # 4 documents per micro-batch


def _rollouts(count: int):
    from rlcli.data.schema import Rollout

    return [
        Rollout(prompt_ids=(1,) * 8, completion_ids=(2,) * (DOC_TOKENS - 8), old_logprobs=(-4.0,) * (DOC_TOKENS - 8),
                advantages=(1.0,) * (DOC_TOKENS - 8), reward=None, group_id=i // 4,
                completion_mask=(1,) * (DOC_TOKENS - 8), temperature=None, source=f"synthetic:{i}", index=i)
        for i in range(count)
    ]


def _time_mode(stream, scorer, *, steps, micro_batches, docs_per_step, with_model):
    from rlcli.training.collect import collect_batch
    from rlcli.training.plan import plan_update

    prepare, total = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step = collect_batch(stream, accumulate_microbatches=micro_batches, docs_per_step=docs_per_step, exact=False)
        plan_update(step.micro_batches, torch.device("cpu"))
        prepared = time.perf_counter()
        if with_model:
            for batch in step.micro_batches:
                logprobs, _ = scorer(batch.input_ids, batch.position_ids, batch.labels)
                logprobs.sum().backward()
        dist.barrier()
        prepare.append(prepared - start)
        total.append(time.perf_counter() - start)
    return statistics.median(prepare) * 1e3, statistics.median(total) * 1e3


def _worker(rank: int, args, port: int, results) -> None:
    from benchmarks.throughput import tiny_config
    from rlcli.data.document_stream import DocumentStream
    from rlcli.model.policy import build_policy
    from rlcli.model.scorer import TokenScorer
    from rlcli.modules import HeadSpec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    scorer = TokenScorer(build_policy(tiny_config()), HeadSpec(chunk_tokens=0), with_entropy=False)
    docs_per_micro_batch = MAX_TOKENS // DOC_TOKENS
    docs_per_step = WORLD_SIZE * args.micro_batches * docs_per_micro_batch
    rollouts = _rollouts(docs_per_step * (args.steps + 1))
    row = {}
    for with_model in (False, True):
        for mode, target in (("static", 0), ("docs_per_step", docs_per_step)):
            stream = DocumentStream(rollouts, max_tokens=MAX_TOKENS, shuffle=False, seed=0, epochs=1,
                                    rank=rank, world_size=WORLD_SIZE)
            prepare_ms, total_ms = _time_mode(stream, scorer, steps=args.steps, micro_batches=args.micro_batches,
                                              docs_per_step=target, with_model=with_model)
            row[f"{mode}_prepare_ms"] = prepare_ms
            if with_model:
                row[f"{mode}_step_ms"] = total_ms
    if rank == 0:
        results.update(row, docs_per_step=docs_per_step, micro_batches=args.micro_batches, steps=args.steps)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.docs_per_step", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode (median reported)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per process and step")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args, _free_port(), results), nprocs=WORLD_SIZE, join=True)
        result = dict(results)
    overhead = result["docs_per_step_prepare_ms"] - result["static_prepare_ms"]
    print(f"2 processes (gloo, 1 thread each), {result['micro_batches']} micro-batches of {MAX_TOKENS} tokens per "
          f"process and step, docs_per_step={result['docs_per_step']}, median of {result['steps']} steps\n")
    print("| mode | step preparation (ms) | step with tiny-model forward+backward (ms) |")
    print("|---|---:|---:|")
    for mode in ("static", "docs_per_step"):
        print(f"| {mode} | {result[f'{mode}_prepare_ms']:.2f} | {result[f'{mode}_step_ms']:.1f} |")
    print(f"\ndocument-count all-reduces add {overhead:.2f} ms per step "
          f"({overhead / result['static_step_ms']:.1%} of a tiny-model step)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
