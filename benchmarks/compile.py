"""``model.compile=true`` against eager: the compile's cost (the first pass) and the steady pass time.

The packed loop of `benchmarks.throughput` (same synthetic rollouts, same tiny Llama built by
`rlcli.model.policy.build_policy`, `TokenScorer` with the fused head + GRPO loss, backward per row) runs
twice, on two copies of the model from the same seed: eager, and with its transformer body compiled as
``model.compile=true`` does (`rlcli.model.policy.compile_body`, dynamic shapes). The first pass of each
runs with inductor's on-disk caches off, so the compiled one pays a whole compile as a first run on a
machine does; then ``--repeats`` passes of each, in turns, give the median pass time and the speed-up
(the median of the ratios of each round). The number of graphs compiled over all passes is counted
(dynamo's counters): one, whatever the lengths of the packed rows.
Usage: ``python -m benchmarks.compile [--json PATH]`` (throughput's model and data options).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchmarks import throughput
from benchmarks.machine import device_name
from benchmarks.output import report


def run(args) -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from rlcli.model.policy import compile_body
    from rlcli.modules import HeadSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch._dynamo.reset()  # count this benchmark's compiles only
    rollouts = throughput._rollouts(args)
    head = HeadSpec(fp32=device.type == "cuda", chunk_tokens=args.chunk_tokens)
    passes, info = {}, {}
    for name in ("eager", "compiled"):
        model, info["attention"] = throughput._model(args, device)
        if name == "compiled":
            compile_body(model)
        passes[name], info["packed_micro_batches"] = throughput._packed_pass(
            rollouts, model, head, device, args.max_tokens)
    result = dict(documents=len(rollouts), real_tokens=sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts),
                  model=dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab), chunk_tokens=args.chunk_tokens,
                  device=str(device), device_name=device_name(device), threads=torch.get_num_threads(),
                  dtype="bfloat16, fp32 head" if device.type == "cuda" else "float32", **info)
    with inductor_config.patch(force_disable_caches=True):  # a cold compile, as on a first run
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            sync()
            result[f"{name}_first_s"] = time.perf_counter() - start
    times = {name: [] for name in passes}
    for _ in range(args.repeats):  # in turns, so that a change in the machine's load shows in both
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    for name in passes:
        result[f"{name}_s"] = statistics.median(times[name])
        result[f"{name}_tokens_per_s"] = result["real_tokens"] / result[f"{name}_s"]
    result["speedup"] = statistics.median(e / c for e, c in zip(times["eager"], times["compiled"]))
    result["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return result


def format_table(r: dict) -> str:
    return "\n".join([
        f"{r['documents']} rollouts, {r['real_tokens']} tokens in {r['packed_micro_batches']} packed rows; tiny Llama "
        f"H={r['model']['hidden']} layers={r['model']['layers']} V={r['model']['vocab']} in {r['dtype']}, attention "
        f"{r['attention']}, fused head chunk_tokens={r['chunk_tokens']}, on {r['device_name']} "
        f"({r['threads']} threads)",
        "",
        "| body | first pass, cold caches (s) | steady pass, median (s) | real tokens/s |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {r[f'{name}_first_s']:.3g} | {r[f'{name}_s']:.3g} | {r[f'{name}_tokens_per_s']:.0f} |"
          for name in ("eager", "compiled")),
        "",
        f"compiled / eager speed: {r['speedup']:.2f}×; graphs compiled over all passes: {r['compiled_graphs']}",
    ])


def main(argv: list[str] | None = None) -> dict:
    args = throughput._parse(argv)
    result = run(args)
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
