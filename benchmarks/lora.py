"""Peak memory and step time of full fine-tuning against LoRA (``model.lora.rank``), and the publish time of
the merged weights against the adapters alone.

A step is what ``rlcli train model.lora.rank=R kl.coef=0.05`` runs for one optimizer update, built by rlcli's
own functions from the composed config: `build_policy`, `add_adapters`, `build_reference` (full fine-tuning:
a frozen copy of the policy; LoRA: the policy with its adapters off, `AdaptersOff`), `MicroBatchLoss`,
`build_optimizer` (AdamW over the trainable parameters). On the synthetic rollouts of `benchmarks.throughput`,
packed by `pack_documents`: the reference's log-probs of every micro-batch (no gradient), the fused head +
GRPO loss with the KL term and backward per micro-batch, gradient clipping, ``optimizer.step()``.

Step time: the three configurations (full, LoRA of each ``--ranks``) of one model live in one process and
run in turns (`time_in_turns`, after a warm-up step of each, whose first step also creates AdamW's state);
reported: the median, and the ratio to full fine-tuning as the median of the ratios of each round. With
``--cpu-time``, each step's CPU time on one thread: on a machine other jobs share, the step's own cost.

Peak memory: each configuration once more in a fresh subprocess (``python -m benchmarks.lora --worker
...``), glibc's mmap threshold at 128 KiB so that freed tensors leave the resident set. The worker first
builds and steps a one-layer model of the same kind (importing the modules and loading the kernels), resets
the process's high-water RSS (``/proc/self/clear_refs``, as `benchmarks.lm_head`), then builds the model,
its reference and optimizer and runs two steps; ``peak`` = the high-water RSS - the RSS before the build:
weights, reference, gradients, optimizer state and the step's activations together. On CUDA
``torch.cuda.max_memory_allocated``.

Publish: for each LoRA configuration, in turns, the merge alone (`merged_weights`, what colocated vLLM
loads), the merged export (`merged_weights` + ``save_pretrained``, what ``export/`` and a published
version hold) and the adapters alone (`save_adapter`: ``export/adapter/``, ``publish.lora=adapter``), with
the bytes each writes; always wall time.

Usage: ``python -m benchmarks lora`` or ``python -m benchmarks.lora [--models 58M ...] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import lm_head
from benchmarks.machine import device_name
from benchmarks.output import report
from benchmarks.throughput import _attention, _rollouts
from benchmarks.timing import device_sync, time_in_turns

REPO_ROOT = Path(__file__).resolve().parents[1]
# model shapes, hidden x intermediate x layers x heads x vocab: the 58M Llama of benchmarks.vllm_sampling, and
# the largest whose three configurations this 2-core machine times in a few minutes (docs/how-to/lora.md)
MODELS = {"58M": "512x1408x8x8x32000", "134M": "768x2048x12x12x32000"}
FULL = "full"
SMALL = dict(hidden=64, intermediate=128, layers=1, heads=1)  # the warm-up model of a memory worker


def _shape(text: str) -> dict:
    """A model name of `MODELS` or its sizes ``HxIxLxHEADSxV``, as a dict."""
    try:
        sizes = [int(x) for x in MODELS.get(text, text).lower().split("x")]
    except ValueError:
        sizes = []
    if len(sizes) != 5 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(MODELS)} or HxIxLxHEADSxV, got {text!r}")
    return dict(zip(("hidden", "intermediate", "layers", "heads", "vocab"), sizes)) | dict(name=text)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=_shape, nargs="+", default=[_shape(name) for name in MODELS],
                        help=f"models to run: {', '.join(MODELS)} or HxIxLxHEADSxV")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64], help="LoRA ranks to run against full")
    parser.add_argument("--documents", type=int, default=16, help="rollouts per step")
    parser.add_argument("--min-completion", type=int, default=16)
    parser.add_argument("--max-completion", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per packed micro-batch")
    parser.add_argument("--kl-coef", type=float, default=0.05, help="kl.coef (0: no reference pass)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each configuration")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (CUDA: bfloat16 model, fp32 head)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each step by this process's CPU time on one thread: on a machine that other jobs "
                             "share, the cost of the step itself (CPU only; the publish stays wall time)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory workers")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.ranks) < 1 or args.repeats < 1 or args.documents < 1:
        parser.error("--ranks, --repeats and --documents must be >= 1")
    if args.cpu_time and not args.device.startswith("cpu"):
        parser.error("--cpu-time: times CPU steps only")
    args.attn = "auto"  # what benchmarks.throughput's attention choice reads
    return args


def _overrides(settings: dict, rank: int) -> list[str]:
    """The `rlcli train` overrides of one configuration."""
    model, device = settings["model"], torch.device(settings["device"])
    cuda = device.type == "cuda"
    return [f"model.hidden_size={model['hidden']}", f"model.intermediate_size={model['intermediate']}",
            f"model.num_layers={model['layers']}", f"model.num_heads={model['heads']}",
            f"model.vocab_size={model['vocab']}",
            f"model.max_position_embeddings={max(1024, settings['max_tokens'])}",
            f"model.dtype={'bfloat16' if cuda else 'float32'}", f"loss.fp32_lm_head={cuda}",
            f"model.attn_implementation={settings['attention']}", f"model.lora.rank={rank}",
            f"kl.coef={settings['kl_coef']}", f"data.max_tokens={settings['max_tokens']}"]


@dataclass
class Configuration:
    """One model and its training step, as `rlcli train` builds them."""

    policy: torch.nn.Module
    step: Callable[[], None]  # one optimizer update over the rollouts
    trainable: int
    total: int


def build(settings: dict, rank: int) -> Configuration:
    """The policy (LoRA of ``rank``, or full fine-tuning for 0), its reference, loss and optimizer, and a step
    over the packed synthetic rollouts. ``settings``: model (a `_shape`), device, attention, kl_coef,
    max_tokens, documents, min_completion, max_completion."""
    from argparse import Namespace

    from hydra import compose, initialize_config_module

    from rlcli.build import build_reference
    from rlcli.conf import quiet_local_config_folder
    from rlcli.conf.validate import validate_config
    from rlcli.data.document_stream import pack_documents
    from rlcli.model.lora import add_adapters, parameter_counts
    from rlcli.model.policy import build_policy
    from rlcli.training.loss import MicroBatchLoss, micro_batch_to_device
    from rlcli.training.module import AdaptersOff
    from rlcli.training.optim import build_optimizer
    from rlcli.training.plan import plan_update

    quiet_local_config_folder()
    with initialize_config_module(config_module="rlcli.conf", version_base="1.3"):
        cfg = validate_config(compose(config_name="config", overrides=_overrides(settings, rank)))
    device = torch.device(settings["device"])
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg.model).to(device)
    if rank:
        add_adapters(policy, cfg.model.lora)
    loss = MicroBatchLoss(cfg.loss, cfg.aggregation, cfg.metrics.level, cfg.kl, cfg.correction)
    scorer = loss.scorer(policy)
    reference = build_reference(cfg, policy)
    if reference is not None:
        reference = AdaptersOff(scorer) if reference is policy else loss.scorer(reference.requires_grad_(False))
    optimizer, _ = build_optimizer(cfg.optimizer, cfg.trainer.max_steps, policy)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    rollouts = _rollouts(Namespace(documents=settings["documents"], min_completion=settings["min_completion"],
                                   max_completion=settings["max_completion"], vocab=settings["model"]["vocab"]))
    rows = list(pack_documents(rollouts, cfg.data.max_tokens))
    plan = plan_update(rows, device)
    micro_batches = [micro_batch_to_device(row, plan.group_numbering, device) for row in rows]

    def step() -> None:
        if reference is not None:
            with torch.no_grad():
                for mb in micro_batches:
                    mb.tensors["reference_logprobs"] = loss.logprobs(reference, mb)  # [L]
        for mb in micro_batches:
            value, _ = loss.loss(scorer, mb, plan)
            value.backward()
        torch.nn.utils.clip_grad_norm_(trainable, cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Configuration(policy, step, *parameter_counts(policy))


def _label(rank: int) -> str:
    return f"lora{rank}" if rank else FULL


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def publish_times(policy: torch.nn.Module, repeats: int, device: torch.device) -> dict:
    """Seconds (median) of the merge, the merged export and the adapters' export of ``policy``, run in turns,
    and the bytes the two exports write."""
    from transformers.utils import logging as transformers_logging

    from rlcli.model.lora import merged_weights, save_adapter

    transformers_logging.disable_progress_bar()  # as export_policy does
    with tempfile.TemporaryDirectory() as tmp:
        merged_dir, adapter_dir = Path(tmp, "merged"), Path(tmp, "adapter")
        ways = {
            "merge": lambda: merged_weights(policy),
            "merged_export": lambda: policy.save_pretrained(merged_dir, state_dict=merged_weights(policy)),
            "adapter_export": lambda: save_adapter(policy, policy.state_dict(), adapter_dir),
        }
        times = time_in_turns(ways, repeats, time.perf_counter, device_sync(device))
        sizes = dict(merged_bytes=_bytes(merged_dir), adapter_bytes=_bytes(adapter_dir))
    return {f"{name}_s": statistics.median(t) for name, t in times.items()} | sizes


def time_configurations(settings: dict, ranks: list[int], repeats: int, clock=time.perf_counter) -> list[dict]:
    """Full fine-tuning and LoRA of each of ``ranks`` on ``settings``' model in one process: their step times
    by ``clock`` in turns, then the publish times of each LoRA configuration."""
    device = torch.device(settings["device"])
    built = {_label(rank): build(settings, rank) for rank in [0, *ranks]}
    times = time_in_turns({name: c.step for name, c in built.items()}, repeats, clock, device_sync(device))
    rows = []
    for rank in [0, *ranks]:
        name, c = _label(rank), built[_label(rank)]
        rows.append(dict(model=settings["model"]["name"], config=name, rank=rank, trainable=c.trainable,
                         total=c.total, step_s=statistics.median(times[name]), step_times_s=times[name],
                         # the median of the ratios of steps run one after the other
                         step_ratio=statistics.median(a / b for a, b in zip(times[name], times[FULL]))))
        if rank:
            rows[-1] |= publish_times(c.policy, repeats, device)
    return rows


def peak_memory(settings: dict, rank: int) -> dict:
    """The peak memory of building configuration ``rank`` and running two steps, beyond what the process
    held before (in this process: `peak_memory_in_subprocess` gives it a fresh one)."""
    device = torch.device(settings["device"])
    # import the modules and load the kernels on a small model of the same kind first, so that their one-off
    # memory is not counted as the configuration's
    small = build(settings | dict(model=settings["model"] | SMALL), rank)
    small.step()
    del small
    gc.collect()
    base, lower_bound = lm_head.start_peak_memory(device)
    c = build(settings, rank)
    for _ in range(2):
        c.step()
    device_sync(device)()
    peak = lm_head.peak_memory(device) - base
    return dict(peak_mib=peak / 2**20, peak_is_lower_bound=lower_bound)


def peak_memory_in_subprocess(settings: dict, rank: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # large blocks are mapped and unmapped: RSS = live memory
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lora", "--worker", json.dumps([settings, rank])],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {settings} rank {rank}:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rows = []
    for model in args.models:
        settings = dict(model=model, device=args.device, attention=_attention(args, device), kl_coef=args.kl_coef,
                        max_tokens=args.max_tokens, documents=args.documents, min_completion=args.min_completion,
                        max_completion=args.max_completion)
        print(f"timing {model['name']}: full and LoRA rank {', '.join(map(str, args.ranks))} in turns ...",
              file=sys.stderr, flush=True)
        group = time_configurations(settings, args.ranks, args.repeats, clock)
        for r in group:
            if args.memory:
                print(f"peak memory of {model['name']} {r['config']} ...", file=sys.stderr, flush=True)
                r |= peak_memory_in_subprocess(settings, r["rank"])
                full = group[0]
                r["memory_ratio"] = r["peak_mib"] / full["peak_mib"]
            r["sizes"] = model
        rows += group
    result = dict(device=args.device, device_name=device_name(device), threads=torch.get_num_threads(),
                  documents=args.documents, completion_range=[args.min_completion, args.max_completion],
                  max_tokens=args.max_tokens, kl_coef=args.kl_coef, repeats=args.repeats,
                  timer="CPU time, one thread" if args.cpu_time else "wall time", rows=rows)
    torch.set_num_threads(threads)
    return result


def format_table(r: dict) -> str:
    lines = [f"{r['documents']} rollouts a step (completions {r['completion_range'][0]}..{r['completion_range'][1]} "
             f"tokens), kl.coef={r['kl_coef']}, AdamW; on {r['device_name']} ({r['threads']} threads); "
             f"median {r['timer']} of {r['repeats']} steps in turns; publish: wall time",
             "",
             "| model | config | trainable / total | step (s) | step vs full | peak memory (MiB) | memory vs full |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        memory = (f"{row['peak_mib']:.0f}{'*' if row['peak_is_lower_bound'] else ''} | {row['memory_ratio']:.2f}"
                  if "peak_mib" in row else "- | -")
        lines.append(f"| {row['model']} | {row['config']} | {row['trainable']:,} / {row['total']:,} "
                     f"({row['trainable'] / row['total']:.2%}) | {row['step_s']:.3g} | {row['step_ratio']:.2f} "
                     f"| {memory} |")
    lines += ["", "| model | config | merge (s) | merged export (s) | merged bytes | adapter export (s) "
              "| adapter bytes |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        if row["rank"]:
            lines.append(f"| {row['model']} | {row['config']} | {row['merge_s']:.3g} | {row['merged_export_s']:.3g} "
                         f"| {row['merged_bytes']:,} | {row['adapter_export_s']:.3g} | {row['adapter_bytes']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    if args.worker is not None:
        settings, rank = json.loads(args.worker)
        print(json.dumps(peak_memory(settings, rank)))
        return {}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    result = run(args)
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
