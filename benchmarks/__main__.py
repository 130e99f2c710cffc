"""``python -m benchmarks [NAME ...] [--json PATH] [--device cpu|cuda]``: run the named benchmarks
(all by default) with the settings of issue 8 and print their tables. Each one also runs alone with
its own options: ``python -m benchmarks.NAME --help``.

* ``lm_head``: the fused head + policy loss (grpo, gspo, ± entropy) against the naive full-logits
  head at N×H×V = 4096×512×32000 and 1024×512×152064, with rlcli's default chunk_tokens=auto, and
  the 6·N·H·V floor at the measured matmul rate;
* ``throughput``: packed micro-batches (pack_documents + TokenScorer + fused head and loss) against a
  padded loop;
* ``docs_per_step``: the document-count all-reduce overhead (CPU, gloo);
* ``loss_terms``: a step with ``loss.old_logprobs=recompute`` and one with a KL penalty to a reference
  model, against a plain step;
* ``stream_queue``: the Redis stream's overhead per record (push, consumer-group read, validation,
  acknowledgement) against reading the same records from a file;
* ``dynamic_sampling``: sampling rounds and seconds a step of ``rollout.filter=zero_variance`` on the
  default task (on the task's reward and on accuracy) against a plain run;
* ``live_loop``: steps per minute and time to the default run's reward, ``rlcli loop`` with 1 and 2
  samplers against synchronous ``data=generate``.
* ``vllm_sampling``: generated tokens per second of rlcli's HFSampler against the VLLMSampler on a tiny
  and a 58M-parameter Llama, the vLLM engine's weight sync (from parameters, from a checkpoint) and
  start time (needs vLLM; skipped when it is not installed).
* ``reward_pool``: seconds per completion of the rewards inline against the reward worker pool (a trivial reward
  and math_verify), and the seconds a ``task=prompts`` step takes inline and with the pool.
* ``dispatch``: the operations PyTorch dispatches and the host-synchronising ones among them, per optimizer
  step of ``rlcli train model=tiny`` (data=rollouts at 4 and 16 micro-batches, generate, stream) and per pass
  of the throughput benchmark's packed and padded loops (exact counts).
* ``compile``: ``model.compile=true`` against eager on the throughput benchmark's packed loop: the first
  pass (a cold compile) and the steady pass time, and the graphs compiled.
* ``lora``: peak memory and step time of full fine-tuning against LoRA ranks 8 and 64 (the 58M model and a
  134M one), and the publish time and bytes of the merged weights against the adapters alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from benchmarks import compile as compile_benchmark
from benchmarks import (
    dispatch,
    docs_per_step,
    dynamic_sampling,
    live_loop,
    lm_head,
    lora,
    loss_terms,
    reward_pool,
    stream_queue,
    throughput,
    vllm_sampling,
)

# the chunk size rlcli's head path is measured with: the default loss.chunk_tokens
DEFAULT_CHUNK_TOKENS = "auto"
SIZES = ["4096x512x32000", "1024x512x152064"]


def _lm_head(device: str, json_path: Path | None):
    argv = ["--sizes", *SIZES, "--losses", "grpo", "gspo", "--entropy", "both",
            "--chunk-tokens", DEFAULT_CHUNK_TOKENS, "--repeats", "5", "--warmup", "1", "--device", device]
    return lm_head.main(argv + (["--json", str(json_path)] if json_path else []))


def _throughput(device: str, json_path: Path | None):
    argv = ["--chunk-tokens", DEFAULT_CHUNK_TOKENS, "--device", device]
    return throughput.main(argv + (["--json", str(json_path)] if json_path else []))


def _docs_per_step(device: str, json_path: Path | None):
    return docs_per_step.main(["--json", str(json_path)] if json_path else [])


def _loss_terms(device: str, json_path: Path | None):
    argv = ["--chunk-tokens", DEFAULT_CHUNK_TOKENS, "--device", device]
    return loss_terms.main(argv + (["--json", str(json_path)] if json_path else []))


def _stream_queue(device: str, json_path: Path | None):
    return stream_queue.main(["--json", str(json_path)] if json_path else [])


def _live_loop(device: str, json_path: Path | None):
    return live_loop.main(["--json", str(json_path)] if json_path else [])


def _dynamic_sampling(device: str, json_path: Path | None):
    return dynamic_sampling.main(["--json", str(json_path)] if json_path else [])


def _vllm_sampling(device: str, json_path: Path | None):
    if importlib.util.find_spec("vllm") is None:
        print("skipped: vLLM is not installed (on a CPU machine `make setup-vllm`)")
        return None
    argv = ["--device", device]
    return vllm_sampling.main(argv + (["--json", str(json_path)] if json_path else []))


def _dispatch(device: str, json_path: Path | None):
    return dispatch.main(["--device", device] + (["--json", str(json_path)] if json_path else []))


def _reward_pool(device: str, json_path: Path | None):
    return reward_pool.main(["--json", str(json_path)] if json_path else [])


def _compile(device: str, json_path: Path | None):
    return compile_benchmark.main(["--device", device] + (["--json", str(json_path)] if json_path else []))


def _lora(device: str, json_path: Path | None):
    return lora.main(["--device", device] + (["--json", str(json_path)] if json_path else []))


BENCHMARKS = {"lm_head": _lm_head, "throughput": _throughput, "docs_per_step": _docs_per_step,
              "loss_terms": _loss_terms, "dynamic_sampling": _dynamic_sampling, "stream_queue": _stream_queue,
              "live_loop": _live_loop, "vllm_sampling": _vllm_sampling, "reward_pool": _reward_pool,
              "dispatch": _dispatch, "compile": _compile, "lora": _lora}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write all results as one JSON file")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (docs_per_step always runs on CPU)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    names = args.names or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        sys.exit(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    results = {}
    for name in names:
        print(f"## {name}", flush=True)
        part = args.json.with_suffix(f".{name}.json") if args.json else None
        BENCHMARKS[name](args.device, part)
        if part is not None and part.is_file():  # a skipped benchmark writes none
            results[name] = json.loads(part.read_text())
            part.unlink()
        print(flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
