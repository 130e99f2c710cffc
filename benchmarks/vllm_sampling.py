"""vLLM against rlcli's built-in HFSampler: generated tokens/s, weight sync time, engine start time.

Two randomly initialised float32 Llama models: ``tiny``, rlcli's default ``model=tiny`` (H=64,
intermediate 128, 2 layers, 2 heads, vocab 64), and ``large`` (H=512, intermediate 1408, 8 layers,
8 heads of 64, vocab 32000, 58M parameters). For each:

* **start**: `VLLMEngine.for_policy` with ``{"dtype": "float32", "enforce_eager": True}``, once,
  split into the engine's construction and its first weight load (the first engine of a run also pays
  vLLM's one-off set-up in the process: ``--models large`` alone times the large model's cold start);
* **sampling**: `HFSampler` on the model and `VLLMSampler` on that engine (no ``policy``, so its
  sampling loads no weights), the same ``--prompts`` prompts of ``--prompt-tokens`` random ids,
  temperature 1, no stop ids (every completion runs to ``max_new_tokens``; the tokens actually
  returned are counted). One warm-up call of each, then ``--repeats`` calls in turns (HF, vLLM, HF,
  ...); tokens/s is the median, the ratio the median of each round's vLLM/HF ratio;
* **sync**: `VLLMEngine.load_weights` from the model's ``named_parameters()`` (what the colocated
  trainer does before each sampling) and from the safetensors of a ``save_pretrained`` checkpoint
  (`checkpoint_weights`, what a sampler process does per published version), median of ``--sync-repeats``.

Usage: ``python -m benchmarks.vllm_sampling [--models tiny large] [--json PATH]`` (needs vLLM: on a CPU
machine ``make setup-vllm``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.machine import device_name
from benchmarks.output import report

# name -> (hidden, intermediate, layers, heads, vocab, max_new_tokens by default)
MODELS = {
    "tiny": dict(hidden=64, intermediate=128, layers=2, heads=2, vocab=64, new_tokens=64),
    "large": dict(hidden=512, intermediate=1408, layers=8, heads=8, vocab=32000, new_tokens=32),
}
ENGINE_OPTIONS = {"dtype": "float32", "enforce_eager": True}
PAD_ID = 0


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_sampling", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompts", type=int, default=64, help="prompts per sampling call")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=0,
                        help="max_new_tokens of every model (0: 64 for tiny, 32 for large)")
    parser.add_argument("--repeats", type=int, default=3, help="timed sampling rounds (one call of each sampler)")
    parser.add_argument("--sync-repeats", type=int, default=3, help="timed weight loads of each kind")
    parser.add_argument("--device", default="cpu", help="where the HF model samples (vLLM picks its own platform)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if min(args.prompts, args.prompt_tokens, args.repeats, args.sync_repeats) < 1 or args.new_tokens < 0:
        parser.error("need --prompts, --prompt-tokens, --repeats, --sync-repeats >= 1 and --new-tokens >= 0")
    return args


def _check_vllm() -> None:
    """Exit with the install hint when vLLM cannot be imported."""
    from rlcli.errors import UserError
    from rlcli.rollout.vllm_engine import _import_vllm

    try:
        _import_vllm()  # also sets the environment rlcli runs vLLM in (the engine core in this process)
    except UserError as err:
        raise SystemExit(f"benchmarks.vllm_sampling needs vLLM: {err}") from None


def _model(spec: dict, device: torch.device) -> torch.nn.Module:
    """A random-init float32 Llama: model=tiny's config (`rlcli.model.policy.tiny_model_config`) at ``spec``'s
    sizes."""
    from transformers import LlamaForCausalLM

    from benchmarks.throughput import tiny_config
    from rlcli.model.policy import tiny_model_config

    cfg = tiny_config()
    cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size = spec["vocab"], spec["hidden"], spec["intermediate"]
    cfg.num_layers, cfg.num_heads = spec["layers"], spec["heads"]
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_model_config(cfg)).to(device=device, dtype=torch.float32).eval()


def _engine(model: torch.nn.Module):
    """``VLLMEngine.for_policy(model, ENGINE_OPTIONS)`` and the seconds of its construction and first weight load."""
    from rlcli.rollout.vllm_engine import VLLMEngine

    class TimedEngine(VLLMEngine):
        """Remembers how long its first `load_weights` (the one in `for_policy`) took."""

        first_load_s: float | None = None

        def load_weights(self, weights):
            seconds = super().load_weights(weights)
            if self.first_load_s is None:
                self.first_load_s = seconds
            return seconds

    started = time.perf_counter()
    engine = TimedEngine.for_policy(model, ENGINE_OPTIONS)
    total = time.perf_counter() - started
    return engine, total - engine.first_load_s, engine.first_load_s


def _sync_times(engine, model: torch.nn.Module, repeats: int) -> dict:
    """Median seconds of loading the model's parameters, and of loading its saved checkpoint, into ``engine``."""
    from rlcli.rollout.vllm_engine import checkpoint_weights

    from_params = [engine.load_weights(model.named_parameters()) for _ in range(repeats)]
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as folder:
        model.save_pretrained(folder)
        size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        from_checkpoint = []
        for _ in range(repeats):
            started = time.perf_counter()  # the reading of the files counts too
            engine.load_weights(checkpoint_weights(folder))
            from_checkpoint.append(time.perf_counter() - started)
    return dict(sync_params_s=statistics.median(from_params), sync_checkpoint_s=statistics.median(from_checkpoint),
                checkpoint_mib=size / 2**20)


def _sampling(samplers: dict, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Warm each sampler up once, then time ``repeats`` rounds of one call each, in turns."""
    def call(sampler, seed):
        started = time.perf_counter()
        completions = sampler.sample(prompts, max_new_tokens=new_tokens, stop_ids=(), pad_id=PAD_ID,
                                     generator=torch.Generator().manual_seed(seed))
        return sum(len(c.ids) for c in completions), time.perf_counter() - started

    for sampler in samplers.values():
        call(sampler, 0)
    # rounds[i][name] = (tokens generated, seconds)
    rounds = [{name: call(sampler, i) for name, sampler in samplers.items()} for i in range(1, repeats + 1)]
    rates = [{name: tokens / seconds for name, (tokens, seconds) in r.items()} for r in rounds]
    out = {}
    for name in samplers:
        out[f"{name}_tokens"] = rounds[0][name][0]
        out[f"{name}_times_s"] = [r[name][1] for r in rounds]
        out[f"{name}_tokens_per_s"] = statistics.median(r[name] for r in rates)
    out["ratio"] = statistics.median(r["vllm"] / r["hf"] for r in rates)  # paired within each round
    return out


def run(args) -> dict:
    from rlcli.rollout.sampler import HFSampler
    from rlcli.rollout.vllm_sampler import VLLMSampler

    _check_vllm()
    device = torch.device(args.device)
    load_before = os.getloadavg()[0]
    results = []
    for name in args.models:
        spec = MODELS[name]
        new_tokens = args.new_tokens or spec["new_tokens"]
        print(f"{name}: starting the vLLM engine ...", file=sys.stderr, flush=True)
        model = _model(spec, device)
        engine, start_s, first_load_s = _engine(model)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(1, spec["vocab"], (args.prompts, args.prompt_tokens), generator=g).tolist()  # [B, P]
        samplers = {"hf": HFSampler(model, temperature=1.0), "vllm": VLLMSampler(engine, temperature=1.0)}
        print(f"{name}: sampling, HF and vLLM in turns ...", file=sys.stderr, flush=True)
        sampled = _sampling(samplers, prompts, new_tokens, args.repeats)
        print(f"{name}: weight sync ...", file=sys.stderr, flush=True)
        synced = _sync_times(engine, model, args.sync_repeats)
        results.append(dict(model=name, **{k: v for k, v in spec.items() if k != "new_tokens"},
                            params_m=sum(p.numel() for p in model.parameters()) / 1e6, prompts=args.prompts,
                            prompt_tokens=args.prompt_tokens, max_new_tokens=new_tokens, start_s=start_s,
                            first_load_s=first_load_s, **sampled, **synced))
        del samplers, engine, model
        gc.collect()
    import vllm

    return dict(device=str(device), device_name=device_name(device), vllm_version=vllm.__version__,
                torch_threads=torch.get_num_threads(), engine_options=ENGINE_OPTIONS, repeats=args.repeats,
                sync_repeats=args.sync_repeats, load_average=[load_before, os.getloadavg()[0]], results=results)


def format_table(r: dict) -> str:
    lines = [
        f"HFSampler vs VLLMSampler (vLLM {r['vllm_version']}, {r['engine_options']}) on {r['device_name']}; "
        f"float32 random-init Llama, temperature 1, no stop ids; median of {r['repeats']} rounds in turns, "
        f"weight loads median of {r['sync_repeats']}; 1-minute load average {r['load_average'][0]:.1f} before, "
        f"{r['load_average'][1]:.1f} after",
        "",
        "| model | params | prompts x (prompt + new) | HF tok/s | vLLM tok/s | vLLM/HF | sync params (s) "
        "| sync checkpoint (s) | engine start (s) | first load (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in r["results"]:
        lines.append(
            f"| {m['model']} H={m['hidden']} L={m['layers']} V={m['vocab']} | {m['params_m']:.2f}M "
            f"| {m['prompts']} x ({m['prompt_tokens']} + {m['max_new_tokens']}) | {m['hf_tokens_per_s']:.0f} "
            f"| {m['vllm_tokens_per_s']:.0f} | {m['ratio']:.2f} | {m['sync_params_s']:.3g} "
            f"| {m['sync_checkpoint_s']:.3g} ({m['checkpoint_mib']:.3g} MiB) | {m['start_s']:.1f} "
            f"| {m['first_load_s']:.3g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    result = run(args)
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
