"""Time and peak memory of the LM head + policy loss, forward and backward, on CPU or CUDA.

What is measured, per configuration: one training micro-step of the loss path,

    fused_micro_batch_loss(hidden, weight, labels, inputs, totals, spec, HeadSpec(chunk_tokens=C)) -> backward

(the head and the policy loss in one pass, as `rlcli train` runs them) with gradients for
``hidden`` and ``weight``, against a *naive* baseline that builds the full
``[N, V]`` logits with ``hidden @ weight.T``, takes ``log_softmax`` and gathers the labels, with
plain autograd (which keeps the full logits and log-softmax alive until the backward), followed by
`policy_loss`.

Time: wall time of forward + backward. One process builds the step once and, after ``--warmup``
untimed runs of every configuration, runs ``--repeats`` rounds (at least 5 by default) that time
the naive path and rlcli's one after the other, so that a change in the machine's load shows in
both alike. Reported: the median (and minimum) of each, and the time ratio as the median of the
ratios of the runs of each round.

Peak memory: every configuration runs once more in a fresh subprocess (``python -m
benchmarks.lm_head --worker ...``) so that no allocation of another configuration can hide or
inflate it, with glibc's mmap threshold fixed at 128 KiB so that every large tensor is its own
mapping, returned to the OS when freed. The worker allocates its inputs, runs the path once on a
tiny problem (loading the kernels), then resets the process's high-water resident set size
(``/proc/self/clear_refs``) and reads it (``VmHWM`` in ``/proc/self/status``) after a warm-up and
one run. ``peak extra`` = high-water RSS - RSS before the runs - the bytes of the ``hidden`` and
``weight`` gradients (outputs that every implementation must produce): the working memory of the
forward + backward (logits, softmax, temporaries), as the OS sees it. On CUDA the same with
``torch.cuda.max_memory_allocated``. Where the high-water mark cannot be reset, the value is
flagged as a lower bound (``*``).

Run it with ``python -m benchmarks`` (all benchmarks) or ``python -m benchmarks.lm_head``; see
``--help``. Results depend on the machine and its load: compare rows of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.machine import cpu_name, device_name

REPO_ROOT = Path(__file__).resolve().parents[1]
NAIVE = "naive"
MEMORY_FIELDS = ("peak_extra_mib", "raw_peak_extra_mib", "grads_mib", "peak_is_lower_bound")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lm_head",
        description="Forward+backward time and peak extra memory of token_logprobs + policy_loss on CPU.",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="N, tokens of the micro-batch")
    parser.add_argument("--hidden", type=int, default=512, help="H, hidden size")
    parser.add_argument("--vocab", type=int, default=32000, help="V, vocabulary size")
    parser.add_argument(
        "--chunk-tokens", type=chunk_tokens_arg, nargs="+", default=["auto"],
        help="loss.chunk_tokens values of the fused head to run (auto = rlcli's default, 0 = one chunk); "
             "the naive baseline runs too unless --no-naive",
    )
    parser.add_argument("--no-naive", action="store_true", help="skip the naive full-logits baseline")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="dtype of hidden and weight (default float32 on CPU, bfloat16 on CUDA; "
                             "bfloat16 runs the head with fp32=True)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--doc-tokens", type=int, default=256, help="tokens per document of the synthetic step")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--sizes", type=_size, nargs="+", default=None, metavar="NxHxV",
                        help="several sizes in one run (overrides --tokens/--hidden/--vocab)")
    parser.add_argument("--losses", nargs="+", choices=["grpo", "gspo"], default=["grpo"], help="policy losses to run")
    parser.add_argument("--entropy", choices=["off", "on", "both"], default="off",
                        help="also compute the entropy (metrics: with_entropy)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (CUDA: bfloat16 inputs, fp32 head)")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip measuring the matmul rate and the 6·N·H·V floor")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("tokens", "hidden", "vocab", "repeats", "doc_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.threads < 0:
        parser.error("--warmup and --threads must be >= 0")
    return args


def chunk_tokens_arg(text: str) -> int | str:
    """``--chunk-tokens`` values: ``auto`` or an integer >= 0."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or auto, got {text!r}")
    return value


# --------------------------------------------------------------------------------------------
# worker: one configuration in a fresh process
# --------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset this process's high-water RSS to its current RSS (Linux); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """High-water resident set size of this process since start or the last reset."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024


def start_peak_memory(device: torch.device) -> tuple[int, bool]:
    """Start a peak-memory window: ``(the bytes held now, whether the peak will be only a lower bound)``;
    CUDA's allocator on a GPU, this process's resident set elsewhere (`peak_memory` ends it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return base, False
    return _rss_bytes(), not _reset_peak_rss()


def peak_memory(device: torch.device) -> int:
    """The most bytes held since `start_peak_memory`."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_rss_bytes()


def _naive_logprobs(hidden, weight, labels, temperature, with_entropy=False):
    """Full logits, log_softmax, gather (and entropy): what the chunked head avoids. Plain autograd
    keeps the ``[N, V]`` logits and log-probabilities alive until the backward."""
    logits = hidden.float() @ weight.float().T  # [N, V]
    log_p = torch.log_softmax(logits / temperature, dim=-1)  # [N, V]
    valid = labels >= 0
    picked = log_p.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)  # [N]
    lp = torch.where(valid, picked, torch.zeros_like(picked))
    if not with_entropy:
        return lp, None
    ent = -(log_p.exp() * log_p).sum(-1)  # [N]
    return lp, torch.where(valid, ent, torch.zeros_like(ent))


def _make_step_inputs(cfg: dict, device: torch.device):
    """A synthetic step: documents of ``doc_tokens`` tokens with a short prompt, four per group."""
    n, h, v = cfg["tokens"], cfg["hidden"], cfg["vocab"]
    dtype = getattr(torch, cfg["dtype"])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device, dtype).requires_grad_(True)
    doc = torch.arange(n) // cfg["doc_tokens"]
    position = torch.arange(n) % cfg["doc_tokens"]
    mask = (position >= min(16, cfg["doc_tokens"] // 4)).float()  # a short prompt per document
    labels = torch.where(mask > 0, torch.randint(0, v, (n,), generator=g), torch.full((n,), -100))
    group = doc // 4  # four documents per prompt
    advantages = torch.randn(n // cfg["doc_tokens"] + 1, generator=g)[doc]  # one advantage per document
    # plausible sampler log-probs: ratios far from 1, some clipped
    sampler_logprobs = -torch.rand(n, generator=g) * 10 - 0.1
    rest = [t.to(device) for t in (labels, mask, doc, group, advantages, sampler_logprobs)]
    return hidden, weight, *rest


def _worker(cfg: dict) -> list[dict]:
    """One process, one synthetic step, the configurations ``cfg["chunks"]`` (``"naive"`` or a
    chunk_tokens value). ``mode="time"``: after ``warmup`` untimed runs of each, ``repeats`` rounds
    that time each configuration once in turn, so that a change in the machine's load shows in all
    of them alike. ``mode="memory"``: one configuration, a warm-up and one run, and the process's
    peak beyond the inputs and their gradients."""
    from rlcli.modules import (
        HeadSpec,
        LossInputs,
        LossSpec,
        Segments,
        StepTotals,
        auto_chunk_tokens,
        fused_micro_batch_loss,
        policy_loss,
    )

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg.get("device", "cpu"))
    cuda = device.type == "cuda"
    loss_name, with_entropy = cfg.get("loss", "grpo"), bool(cfg.get("entropy", False))
    metrics = "with_entropy" if with_entropy else "basic"
    torch.manual_seed(0)
    hidden, weight, labels, mask, doc, group, advantages, sampler_logprobs = _make_step_inputs(cfg, device)
    # the fp32 head for half inputs (what the trainer runs with fp32_lm_head: true)
    fp32 = hidden.dtype in (torch.float16, torch.bfloat16)
    spec = LossSpec(loss_name, aggregation="token_mean", metrics=metrics)

    def forward_backward(hidden, weight, labels, sl, chunk):
        inputs = LossInputs(proximal_logprobs=sampler_logprobs[sl], advantages=advantages[sl], mask=mask[sl],
                            document_index=doc[sl], group_index=group[sl])
        if chunk == NAIVE:
            lp, ent = _naive_logprobs(hidden, weight, labels, 1.0, with_entropy)
            loss, _ = policy_loss(lp, inputs, spec, entropy=ent)
        else:
            totals = StepTotals.of_tokens(mask[sl], Segments.of(doc[sl]), group[sl], int(group[sl].max()) + 1)
            loss, _ = fused_micro_batch_loss(hidden, weight, labels, inputs, totals, spec,
                                             HeadSpec(fp32=fp32, chunk_tokens=chunk))
        loss.backward()
        return loss

    def step(chunk) -> float:
        hidden.grad = None
        weight.grad = None
        loss = forward_backward(hidden, weight, labels, slice(None), chunk)
        if cuda:
            torch.cuda.synchronize(device)
        return float(loss.detach())

    # load and initialise the kernels (BLAS, softmax, autograd) on a tiny problem first, so that
    # their one-off buffers are not counted as the configuration's memory
    tiny_h = hidden.detach()[:8].clone().requires_grad_(True)
    tiny_w = weight.detach()[:64].clone().requires_grad_(True)
    for chunk in cfg["chunks"]:
        forward_backward(tiny_h, tiny_w, labels[:8].clamp(max=63), slice(0, 8), chunk if chunk == NAIVE else 4)
    del tiny_h, tiny_w

    def describe(chunk) -> dict:
        used = auto_chunk_tokens(cfg["vocab"], device.type) if chunk == "auto" else chunk
        return dict(chunk_tokens=chunk, chunk_tokens_used=used, loss_name=loss_name, entropy=with_entropy,
                    device=str(device), threads=torch.get_num_threads())

    if cfg["mode"] == "memory":
        (chunk,) = cfg["chunks"]
        # the gradients of hidden and weight are outputs every implementation must produce (and the
        # optimizer keeps): "peak extra" is what the step needs beyond the inputs and these gradients
        grads_bytes = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
        base, lower_bound = start_peak_memory(device)
        for _ in range(cfg["warmup"] + 1):
            loss = step(chunk)
        raw_extra = peak_memory(device) - base
        return [describe(chunk) | dict(
            peak_extra_mib=max(raw_extra - grads_bytes, 0) / 2**20, raw_peak_extra_mib=raw_extra / 2**20,
            grads_mib=grads_bytes / 2**20, peak_is_lower_bound=lower_bound, loss=loss,
        )]

    for _ in range(cfg["warmup"]):
        for chunk in cfg["chunks"]:
            step(chunk)
    times = {chunk: [] for chunk in cfg["chunks"]}
    losses = {}
    for _ in range(cfg["repeats"]):
        for chunk in cfg["chunks"]:
            start = time.perf_counter()
            losses[chunk] = step(chunk)
            times[chunk].append(time.perf_counter() - start)
    return [describe(chunk) | dict(median_s=statistics.median(times[chunk]), min_s=min(times[chunk]),
                                   times_s=times[chunk], loss=losses[chunk]) for chunk in cfg["chunks"]]


def matmul_flops(tokens: int, hidden: int, vocab: int, *, device: str = "cpu", repeats: int = 5,
                 threads: int = 0) -> float:
    """Measured float32 FLOP/s of the ``[N, H] x [H, V]`` product: the faster of ``h @ W.T`` into
    ``[N, V]`` and ``W @ h.T`` into ``[V, N]`` (BLAS runs them at different rates), each the median
    of ``repeats`` after a warm-up."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    h = torch.randn(tokens, hidden, device=dev)
    w = torch.randn(vocab, hidden, device=dev)
    best = float("inf")
    for a, b in ((h, w), (w, h)):
        out = torch.empty(a.shape[0], b.shape[0], device=dev)  # [N, V], then [V, N]
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            torch.mm(a, b.T, out=out)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i:
                times.append(time.perf_counter() - start)
        best = min(best, statistics.median(times))
        del out  # one output buffer at a time
    return 2 * tokens * hidden * vocab / best


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _run_in_subprocess(cfg: dict) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # large blocks are mapped and unmapped: RSS = live memory
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.lm_head", "--worker", json.dumps(cfg)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {cfg}:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _chunk_text(r: dict) -> str:
    """``auto (512)``, ``0`` or ``256``: the chunk_tokens asked for, and what ``auto`` became."""
    if r["chunk_tokens"] == "auto":
        return f"auto ({r['chunk_tokens_used']})"
    return str(r["chunk_tokens"])


def _label(r: dict) -> str:
    if r["chunk_tokens"] == NAIVE:
        return "naive (full logits, autograd)"
    if r["chunk_tokens"] == 0:
        return "rlcli fused head + loss, one chunk"
    return f"rlcli fused head + loss, chunk_tokens={_chunk_text(r)}"


def format_table(results: list[dict], config: dict) -> str:
    full_logits_mib = config["tokens"] * config["vocab"] * 4 / 2**20
    lines = [
        f"N={config['tokens']} H={config['hidden']} V={config['vocab']} dtype={config['dtype']}, "
        f"{config['repeats']} timed runs after {config['warmup']} warm-up, "
        f"torch {config['torch']} on {config['cpu']} with {results[0]['threads'] if results else '?'} threads; "
        f"one fp32 [N, V] logits tensor = {full_logits_mib:.0f} MiB",
        "",
        "| configuration | fwd+bwd median (s) | min (s) | peak extra memory (MiB) | loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        star = "*" if r["peak_is_lower_bound"] else ""
        lines.append(
            f"| {_label(r)} | {r['median_s']:.3g} | {r['min_s']:.3g} | "
            f"{r['peak_extra_mib']:.0f}{star} | {r['loss']:.6f} |"
        )
    return "\n".join(lines)


def _size(text: str) -> tuple[int, int, int]:
    try:
        n, h, v = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NxHxV, e.g. 4096x512x32000, got {text!r}") from None
    if min(n, h, v) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return n, h, v


def format_comparison(rows: list[dict]) -> str:
    """The side-by-side table: naive vs token_logprobs per (size, loss, entropy), with the FLOP floor."""
    lines = [
        "| N×H×V | loss | entropy | chunk | naive s | rlcli s | time ratio | naive MiB | rlcli MiB | mem ratio "
        "| floor s (6NHV) | rlcli % of floor | naive % of floor |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']}×{r['hidden']}×{r['vocab']} | {r['loss_name']} | {'yes' if r['entropy'] else 'no'} "
            f"| {r['chunk']} | {r['naive_s']:.3g} | {r['rlcli_s']:.3g} | {r['time_ratio']:.2f} "
            f"| {r['naive_mib']:.0f} | {r['rlcli_mib']:.0f} | {r['mem_ratio']:.3f} | {r['floor_s']:.3g} "
            f"| {r['rlcli_floor_fraction']:.0%} | {r['naive_floor_fraction']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parse(argv)
    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return []
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    dtype = args.dtype if args.dtype is not None else ("bfloat16" if args.device.startswith("cuda") else "float32")
    sizes = args.sizes or [(args.tokens, args.hidden, args.vocab)]
    entropies = {"off": [False], "on": [True], "both": [False, True]}[args.entropy]
    chunks = ([] if args.no_naive else [NAIVE]) + list(dict.fromkeys(args.chunk_tokens))
    measured_on = device_name(args.device)
    results, comparison, rates = [], [], {}
    for n, h, v in sizes:
        if args.floor:
            rates[f"{n}x{h}x{v}"] = rate = matmul_flops(n, h, v, device=args.device, threads=args.threads)
            print(f"float32 [{n}, {h}] @ [{h}, {v}] matmul on {measured_on}: {rate / 1e9:.1f} GFLOP/s",
                  file=sys.stderr, flush=True)
        for loss_name in dict.fromkeys(args.losses):
            for entropy in entropies:
                base = dict(
                    tokens=n, hidden=h, vocab=v, repeats=args.repeats, warmup=args.warmup, dtype=dtype,
                    threads=args.threads, doc_tokens=args.doc_tokens, loss=loss_name, entropy=entropy,
                    device=args.device,
                )
                print(f"timing {n}x{h}x{v} {loss_name} entropy={entropy}: {', '.join(map(str, chunks))} in turns ...",
                      file=sys.stderr, flush=True)
                group = _run_in_subprocess(base | {"mode": "time", "chunks": chunks})
                for r in group:
                    print(f"peak memory of {n}x{h}x{v} {loss_name} entropy={entropy}: {r['chunk_tokens']} ...",
                          file=sys.stderr, flush=True)
                    (memory,) = _run_in_subprocess(base | {"mode": "memory", "chunks": [r["chunk_tokens"]]})
                    r |= {k: memory[k] for k in MEMORY_FIELDS} | dict(tokens=n, hidden=h, vocab=v)
                results += group
                naive = next((r for r in group if r["chunk_tokens"] == NAIVE), None)
                floor_s = 6 * n * h * v / rates[f"{n}x{h}x{v}"] if args.floor else float("nan")
                for r in group:
                    if naive is None or r is naive:
                        continue
                    comparison.append(dict(
                        tokens=n, hidden=h, vocab=v, loss_name=loss_name, entropy=entropy,
                        chunk_tokens=r["chunk_tokens"], chunk=_chunk_text(r), naive_s=naive["median_s"],
                        rlcli_s=r["median_s"],
                        # the median of the ratios of runs made one after the other
                        time_ratio=statistics.median(a / b for a, b in zip(r["times_s"], naive["times_s"])),
                        naive_mib=naive["peak_extra_mib"],
                        rlcli_mib=r["peak_extra_mib"],
                        mem_ratio=r["peak_extra_mib"] / max(naive["peak_extra_mib"], 1e-9), floor_s=floor_s,
                        rlcli_floor_fraction=floor_s / r["median_s"], naive_floor_fraction=floor_s / naive["median_s"],
                    ))
    config = dict(
        tokens=sizes[0][0], hidden=sizes[0][1], vocab=sizes[0][2], sizes=[list(x) for x in sizes],
        repeats=args.repeats, warmup=args.warmup, dtype=dtype, threads=args.threads, doc_tokens=args.doc_tokens,
        losses=list(dict.fromkeys(args.losses)), entropy=args.entropy, device=args.device, device_name=measured_on,
        torch=torch.__version__, cpu=cpu_name(), python=platform.python_version(),
        matmul_flops=rates,
    )
    print(f"device: {measured_on}; {dtype} inputs{' (fp32 head)' if dtype != 'float32' else ''}; "
          f"{args.repeats} timed runs after {args.warmup} warm-up, median; peak extra memory = peak beyond the "
          "inputs and their gradients (RSS high-water on CPU, max_memory_allocated on CUDA)")
    for key, rate in rates.items():
        print(f"measured float32 matmul rate at {key.replace('x', '×')}: {rate / 1e9:.1f} GFLOP/s "
              f"(floor of the head = 6·N·H·V FLOPs at this rate)")
    if len(sizes) == 1 and len(config["losses"]) == 1 and len(entropies) == 1:
        print(format_table(results, config))
    if comparison:
        print()
        print(format_comparison(comparison))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(config=config, results=results, comparison=comparison), indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
