"""One rank of a 2-process CPU job (gloo) that runs several short `train()` calls in a row.

Started by `launch.run_ranks` with torchrun-style variables, so Lightning joins the given process
group instead of starting processes itself. Usage: ``dist_worker.py JOBS.json OUT_DIR``. Each job
is ``{"name": ..., "overrides": [...]}``; for each, rank 0 saves ``OUT_DIR/NAME.pt`` with the
final parameters, and every rank saves ``OUT_DIR/NAME.rank<R>.json`` with the document indices of
each micro-batch it trained on, step by step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import rlcli.training.sources.files as file_sources
from rlcli.commands.train import train
from rlcli.training import distributed
from rlcli.training.collect import collect_batch
from train_helpers import compose_train_config


def main(jobs_file: str, out_dir: str) -> None:
    out = Path(out_dir)
    steps: list[list[list[int]]] = []

    def recording_collect_batch(*args, **kwargs):
        collected = collect_batch(*args, **kwargs)
        steps.append([[doc.index for doc in batch.documents] for batch in collected.micro_batches])
        return collected

    file_sources.collect_batch = recording_collect_batch
    for job in json.loads(Path(jobs_file).read_text()):
        steps.clear()
        started = time.perf_counter()
        torch.manual_seed(0)
        module = train(compose_train_config(job["overrides"]), out / job["name"])
        (out / f"{job['name']}.rank{distributed.rank()}.json").write_text(json.dumps(steps))
        if module.trainer.is_global_zero:
            from transformers import AutoModelForCausalLM

            exported = AutoModelForCausalLM.from_pretrained(out / job["name"] / "export")
            torch.save({k: v.detach().clone() for k, v in exported.state_dict().items()}, out / f"{job['name']}.pt")
        print(f"[dist_worker] job {job['name']} took {time.perf_counter() - started:.1f} s", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # every job's files are written: end here, without the interpreter's teardown, where gloo's threads can
    # still abort a rank (SIGABRT, "terminate called without an active exception"; seen twice in CI, after
    # the last job, even with the process group destroyed). A failing job raised before this line.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
