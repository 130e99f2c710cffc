"""Time and peak memory of the LM head + policy loss, forward and backward, on CPU.

What is measured, per configuration: one training micro-step of the loss path,

    token_logprobs(hidden, weight, labels, chunk_tokens=C) -> policy_loss(grpo, token_mean) -> backward

with gradients for ``hidden`` and ``weight``, against a *naive* baseline that builds the full
``[N, V]`` logits with ``hidden @ weight.T``, takes ``log_softmax`` and gathers the labels, with
plain autograd (which keeps the full logits and log-softmax alive until the backward).

Time: wall time of forward + backward, ``--warmup`` untimed runs first, then the median (and
minimum) of ``--repeats`` timed runs (at least 5 by default).

Peak memory: every configuration runs in a fresh subprocess (``python -m benchmarks.lm_head
--worker ...``) so that no allocation of another configuration can hide or inflate it. The worker
allocates and fills its inputs, reads its current resident set size (RSS, ``/proc/self/statm``),
runs warm-up and repeats, then reads ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the
process's high-water RSS). ``peak extra`` = high-water RSS − RSS after the inputs exist: the
memory the forward + backward needs on top of the inputs (logits, softmax, gradients and the
allocator's slack). This is real memory as the OS sees it. PyTorch's CPU allocator does not cache,
and glibc returns large blocks (≥ 32 MiB) to the OS, so the value is per-iteration peak and not
an accumulation. If the high-water mark was already set before the inputs were allocated (import
time), the result is flagged as a lower bound (``*``); with the sizes of interest it is not.

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

REPO_ROOT = Path(__file__).resolve().parents[1]
NAIVE = "naive"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lm_head",
        description="Forward+backward time and peak extra memory of token_logprobs + policy_loss on CPU.",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="N, tokens of the micro-batch")
    parser.add_argument("--hidden", type=int, default=512, help="H, hidden size")
    parser.add_argument("--vocab", type=int, default=32000, help="V, vocabulary size")
    parser.add_argument(
        "--chunk-tokens", type=int, nargs="+", default=[0, 1024, 256],
        help="chunk_tokens values of token_logprobs to run (0 = unchunked); the naive baseline always runs",
    )
    parser.add_argument("--no-naive", action="store_true", help="skip the naive full-logits baseline")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of hidden and weight (bfloat16 runs the head with fp32=True)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--doc-tokens", type=int, default=256, help="tokens per document of the synthetic step")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("tokens", "hidden", "vocab", "repeats", "doc_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.threads < 0:
        parser.error("--warmup and --threads must be >= 0")
    if any(c < 0 for c in args.chunk_tokens):
        parser.error("--chunk-tokens must be >= 0")
    return args


# --------------------------------------------------------------------------------------------
# worker: one configuration in a fresh process
# --------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    """High-water resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _naive_logprobs(hidden, weight, labels, temperature):
    """Full logits, log_softmax, gather: what the chunked head avoids."""
    logits = hidden.float() @ weight.float().T  # [N, V]
    log_p = torch.log_softmax(logits / temperature, dim=-1)  # [N, V]
    valid = labels >= 0
    picked = log_p.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)  # [N]
    return torch.where(valid, picked, torch.zeros_like(picked))


def _worker(cfg: dict) -> dict:
    from rlcli.modules import policy_loss, token_logprobs

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    n, h, v = cfg["tokens"], cfg["hidden"], cfg["vocab"]
    dtype = getattr(torch, cfg["dtype"])
    hidden = torch.randn(n, h, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(v, h) / h**0.5).to(dtype).requires_grad_(True)
    doc = torch.arange(n) // cfg["doc_tokens"]
    position = torch.arange(n) % cfg["doc_tokens"]
    mask = (position >= min(16, cfg["doc_tokens"] // 4)).float()  # a short prompt per document
    labels = torch.where(mask > 0, torch.randint(0, v, (n,)), torch.full((n,), -100))
    group = doc // 4  # four documents per prompt
    advantages = torch.randn(n // cfg["doc_tokens"] + 1)[doc]  # one advantage per document
    old_logprobs = -torch.rand(n) * 10 - 0.1  # plausible sampler log-probs: ratios far from 1, some clipped

    def step():
        hidden.grad = None
        weight.grad = None
        if cfg["chunk_tokens"] == NAIVE:
            lp = _naive_logprobs(hidden, weight, labels, 1.0)
        else:
            lp, _ = token_logprobs(hidden, weight, labels, fp32=True, chunk_tokens=cfg["chunk_tokens"])
        loss, _ = policy_loss(lp, old_logprobs, advantages, mask, doc, group, loss="grpo", aggregation="token_mean")
        loss.backward()
        return float(loss.detach())

    # load and initialise the kernels (BLAS, softmax, autograd) on a tiny problem first, so that
    # their one-off buffers are not counted as the configuration's memory
    tiny_h = hidden.detach()[:8].clone().requires_grad_(True)
    tiny_w = weight.detach()[:64].clone().requires_grad_(True)
    tiny_labels = labels[:8].clamp(max=63)
    if cfg["chunk_tokens"] == NAIVE:
        tiny_lp = _naive_logprobs(tiny_h, tiny_w, tiny_labels, 1.0)
    else:
        tiny_lp, _ = token_logprobs(tiny_h, tiny_w, tiny_labels, fp32=True, chunk_tokens=min(cfg["chunk_tokens"], 4))
    tiny_loss, _ = policy_loss(tiny_lp, old_logprobs[:8], advantages[:8], mask[:8], doc[:8], group[:8])
    tiny_loss.backward()
    del tiny_h, tiny_w, tiny_lp, tiny_loss

    rss_inputs = _rss_bytes()
    maxrss_inputs = _maxrss_bytes()
    for _ in range(cfg["warmup"]):
        step()
    times = []
    for _ in range(cfg["repeats"]):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    maxrss_end = _maxrss_bytes()
    return dict(
        chunk_tokens=cfg["chunk_tokens"],
        median_s=statistics.median(times),
        min_s=min(times),
        times_s=times,
        peak_extra_mib=(maxrss_end - rss_inputs) / 2**20,
        peak_is_lower_bound=maxrss_end <= maxrss_inputs,
        loss=loss,
        threads=torch.get_num_threads(),
    )


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _run_in_subprocess(cfg: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.lm_head", "--worker", json.dumps(cfg)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {cfg}:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def _label(chunk) -> str:
    if chunk == NAIVE:
        return "naive (full logits, autograd)"
    if chunk == 0:
        return "token_logprobs, unchunked"
    return f"token_logprobs, chunk_tokens={chunk}"


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
            f"| {_label(r['chunk_tokens'])} | {r['median_s']:.3g} | {r['min_s']:.3g} | "
            f"{r['peak_extra_mib']:.0f}{star} | {r['loss']:.6f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parse(argv)
    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return []
    base = dict(
        tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, repeats=args.repeats, warmup=args.warmup,
        dtype=args.dtype, threads=args.threads, doc_tokens=args.doc_tokens,
    )
    chunks = ([] if args.no_naive else [NAIVE]) + list(dict.fromkeys(args.chunk_tokens))
    results = []
    for chunk in chunks:
        print(f"running {_label(chunk)} ...", file=sys.stderr, flush=True)
        results.append(_run_in_subprocess(base | {"chunk_tokens": chunk}))
    config = base | dict(torch=torch.__version__, cpu=_cpu_name(), python=platform.python_version())
    print(format_table(results, config))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(config=config, results=results), indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
