"""``model.compile=true`` against eager: the compile's cost (the first pass) and the steady pass time.

The packed loop of `benchmarks.throughput` (same synthetic rollouts, same tiny Llama built by
`rlcli.model.policy.build_policy`, `TokenScorer` with the fused head + GRPO loss, backward per row) runs
twice, on two copies of the model from the same seed: eager, and compiled as ``model.compile=true`` does
(the transformer body by `rlcli.model.policy.compile_body`, the loss by ``HeadSpec(compile=True)``; dynamic
shapes). The first pass of each
runs with inductor's on-disk caches off, so the compiled one pays a whole compile as a first run on a
machine does; then ``--repeats`` passes of each, in turns, give the median pass time and the speed-up
(the median of the ratios of each round). The number of graphs compiled over all passes is counted
(dynamo's counters): one, whatever the lengths of the packed rows. ``--cpu-time`` runs on one thread
and times the steady passes by this process's CPU time (what a pass costs on a machine that other jobs
share); the first pass is always wall time (inductor compiles in worker processes).
Usage: ``python -m benchmarks.compile [--cpu-time] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import throughput
from benchmarks.lm_head import chunk_tokens_arg
from benchmarks.machine import device_name
from benchmarks.output import report
from benchmarks.timing import device_sync, time_in_turns


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile", description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=64, help="rollouts per pass")
    parser.add_argument("--min-completion", type=int, default=16)
    parser.add_argument("--max-completion", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per packed row")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-tokens", type=chunk_tokens_arg, default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (CUDA: bfloat16 model, fp32 head)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, steady passes timed by this process's CPU time (CPU only)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if args.cpu_time and args.device != "cpu":
        parser.error("--cpu-time: times CPU passes only")
    args.attn = "auto"  # what benchmarks.throughput's model builder reads
    return args


def run(args) -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from rlcli.model.policy import compile_body
    from rlcli.modules import HeadSpec

    if args.threads or args.cpu_time:
        torch.set_num_threads(1 if args.cpu_time else args.threads)
    device = torch.device(args.device)
    sync = device_sync(device)
    torch._dynamo.reset()  # count this benchmark's compiles only
    rollouts = throughput._rollouts(args)
    passes, info = {}, {}
    for name in ("eager", "compiled"):
        model, info["attention"] = throughput._model(args, device)
        if name == "compiled":
            compile_body(model)
        head = HeadSpec(fp32=device.type == "cuda", chunk_tokens=args.chunk_tokens, compile=name == "compiled")
        passes[name], info["packed_micro_batches"] = throughput._packed_pass(
            rollouts, model, head, device, args.max_tokens)
    result = dict(documents=len(rollouts), real_tokens=sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts),
                  model=throughput.model_sizes(args), chunk_tokens=args.chunk_tokens,
                  device=str(device), device_name=device_name(device), threads=torch.get_num_threads(),
                  dtype="bfloat16, fp32 head" if device.type == "cuda" else "float32",
                  timer="CPU time, one thread" if args.cpu_time else "wall time", **info)
    with inductor_config.patch(force_disable_caches=True):  # a cold compile, as on a first run
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            sync()
            result[f"{name}_first_s"] = time.perf_counter() - start
    clock = time.process_time if args.cpu_time else time.perf_counter
    times = time_in_turns(passes, args.repeats, clock, sync, warm_up=False)  # the first pass warmed up
    for name in passes:
        result[f"{name}_s"] = statistics.median(times[name])
        result[f"{name}_tokens_per_s"] = result["real_tokens"] / result[f"{name}_s"]
    result["speedup"] = statistics.median(e / c for e, c in zip(times["eager"], times["compiled"]))
    result["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return result


def format_table(r: dict) -> str:
    return "\n".join([
        f"{r['documents']} rollouts, {r['real_tokens']} tokens in {r['packed_micro_batches']} packed rows; tiny Llama "
        f"H={r['model']['hidden']} layers={r['model']['layers']} "
        f"heads={r['model']['heads']} V={r['model']['vocab']} in {r['dtype']}, attention "
        f"{r['attention']}, fused head chunk_tokens={r['chunk_tokens']}, on {r['device_name']} "
        f"({r['threads']} threads)",
        "",
        f"| body | first pass, cold caches (s, wall) | steady pass, median (s, {r['timer']}) | real tokens/s |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {r[f'{name}_first_s']:.3g} | {r[f'{name}_s']:.3g} | {r[f'{name}_tokens_per_s']:.0f} |"
          for name in ("eager", "compiled")),
        "",
        f"compiled / eager speed: {r['speedup']:.2f}×; graphs compiled over all passes: {r['compiled_graphs']}",
    ])


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    threads = torch.get_num_threads()
    try:
        result = run(args)
    finally:
        torch.set_num_threads(threads)
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
