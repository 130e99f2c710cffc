"""Training throughput (tokens/s) of rlcli's packed micro-batches against a padded-batch loop.

Both loops train on the same synthetic rollouts (prompt 16 tokens, completion lengths spread
uniformly over ``--min-completion``..``--max-completion``, so ≥ 4× apart by default), with the same
tiny Llama-style model built by `rlcli.model.policy.build_policy` and the same GRPO token-mean loss:

* **packed** (rlcli): `pack_documents` rows of at most ``--max-tokens`` tokens, no padding, planned on the host
  and moved to the device once as the trainer does, and
  `TokenScorer` with the fused head + GRPO loss (``--chunk-tokens``) and backward per row;
* **padded** (the usual loop): batches of ``--batch-size`` documents in the same order, right-padded
  to the longest, ``attention_mask``, the model's full ``[B, L, V]`` logits (on CUDA with the head in
  float32 like the packed path), log-softmax, gather, the same loss, backward. ``--batch-size``
  defaults to the number of documents a packed row holds on average, so both loops see about the
  same real tokens per forward.

Throughput = real (unpadded) tokens of all documents / wall time of one pass over them (median of
``--repeats`` passes after a warm-up pass of each); the two loops run their passes in turns, and
the speed-up is the median of the ratios of each round. Usage: ``python -m benchmarks.throughput [--json PATH]``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.lm_head import chunk_tokens_arg
from benchmarks.machine import device_name
from benchmarks.output import report
from benchmarks.timing import device_sync, time_in_turns

PROMPT_TOKENS = 16
HEAD_SIZE = 64  # the model's attention head size, as in real models


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=64, help="rollouts per pass")
    parser.add_argument("--min-completion", type=int, default=16)
    parser.add_argument("--max-completion", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per packed micro-batch")
    parser.add_argument("--batch-size", type=int, default=0, help="documents per padded batch (0: match packed)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-tokens", type=chunk_tokens_arg, default="auto",
                        help="loss.chunk_tokens of the packed path (auto: rlcli's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (CUDA: bfloat16 model, fp32 head)")
    parser.add_argument("--attn", default="auto", choices=["auto", "sdpa", "eager", "flash_attention_2", "varlen"],
                        help="model.attn_implementation of the packed loop (auto: on CUDA flash_attention_2 when the "
                             "flash-attn package is installed, else rlcli's varlen, both of which attend within each "
                             "packed document only; on CPU sdpa with a block-diagonal mask, rlcli's default). The "
                             "padded loop runs sdpa with its padding mask whatever this says.")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if not 1 <= args.min_completion <= args.max_completion or args.documents < 1 or args.repeats < 1:
        parser.error("need 1 <= --min-completion <= --max-completion, --documents >= 1, --repeats >= 1")
    return args


def _rollouts(args):
    from rlcli.data.schema import Rollout

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_completion, args.max_completion + 1, (args.documents,), generator=g).tolist()
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, args.vocab, (PROMPT_TOKENS + n,), generator=g).tolist()
        old = (-torch.rand(n, generator=g) * 4 - 0.1).tolist()
        adv = float(torch.randn((), generator=g))
        out.append(Rollout(prompt_ids=tuple(ids[:PROMPT_TOKENS]), completion_ids=tuple(ids[PROMPT_TOKENS:]),
                           old_logprobs=tuple(old), advantages=(adv,) * n, reward=None, group_id=i // 4,
                           completion_mask=(1,) * n, temperature=None, source=f"synthetic:{i}", index=i))
    return out


def _attention(args, device) -> str:
    if args.attn != "auto":
        return args.attn
    if device.type != "cuda":
        return "sdpa"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "varlen"


def model_sizes(args) -> dict:
    """The benchmark model's sizes, as the results record them."""
    return dict(hidden=args.hidden, layers=args.layers, heads=max(1, args.hidden // HEAD_SIZE), vocab=args.vocab)


def tiny_config():
    """``model=tiny``'s config (rlcli/conf/model/tiny.yaml), an OmegaConf node for a benchmark to resize."""
    from omegaconf import OmegaConf

    return OmegaConf.load(Path(__file__).resolve().parents[1] / "rlcli/conf/model/tiny.yaml")


def _model(args, device):
    from rlcli.model.policy import build_policy

    cfg = tiny_config()
    cfg.hidden_size, cfg.intermediate_size, cfg.num_layers = args.hidden, 2 * args.hidden, args.layers
    # model=tiny's 2 heads would be 512 wide at H=1024, over the flash
    # kernels' limit of 256, and attention would fall back to the quadratic-memory math kernel
    cfg.num_heads = model_sizes(args)["heads"]
    cfg.vocab_size, cfg.max_position_embeddings = args.vocab, max(1024, args.max_tokens)
    cfg.dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg.attn_implementation = _attention(args, device)
    torch.manual_seed(0)
    return build_policy(cfg).to(device), cfg.attn_implementation


def _padded_batch(docs, device):
    """Right-padded [B, L] inputs and per-position targets (the next token where it is a completion token)."""
    length = max(len(d.prompt_ids) + len(d.completion_ids) for d in docs)
    b = len(docs)
    input_ids = torch.zeros(b, length, dtype=torch.long)
    attention = torch.zeros(b, length, dtype=torch.long)
    labels = torch.full((b, length), -100, dtype=torch.long)
    old = torch.zeros(b, length)
    adv = torch.zeros(b, length)
    for i, d in enumerate(docs):
        ids = d.prompt_ids + d.completion_ids
        p, n = len(d.prompt_ids), len(d.completion_ids)
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, p - 1 : p - 1 + n] = torch.tensor(d.completion_ids)
        old[i, p - 1 : p - 1 + n] = torch.tensor(d.old_logprobs)
        adv[i, p - 1 : p - 1 + n] = torch.tensor(d.advantages)
    return [t.to(device) for t in (input_ids, attention, labels, old, adv)]


@dataclass
class Loops:
    """The two loops over the same rollouts, on the same model, and what the result table says about them."""

    packed: Callable[[], None]  # one pass of the packed loop over all rollouts (forward, loss, backward per row)
    padded: Callable[[], None]  # one pass of the padded loop over the same rollouts
    info: dict  # rollouts, forwards, tokens, model, device: the result's fixed fields


def _packed_pass(rollouts, model, head, device, max_tokens) -> tuple[Callable[[], None], int]:
    """rlcli's packed loop as the trainer runs it: ``pack_documents`` rows, each planned on the host and moved
    to the device once (`plan_update`, `micro_batch_to_device`: nothing in the pass waits for the device),
    then ``TokenScorer`` with the fused head + GRPO loss; each row is an update. Returns (pass, rows)."""
    from rlcli.data.document_stream import pack_documents
    from rlcli.model.scorer import TokenScorer
    from rlcli.modules import LossInputs, LossSpec, fused_micro_batch_loss
    from rlcli.training.loss import micro_batch_to_device
    from rlcli.training.plan import plan_update

    rows = list(pack_documents(rollouts, max_tokens))
    plans = [plan_update([row], device) for row in rows]
    packed = [(micro_batch_to_device(row, plan.group_numbering, device), plan) for row, plan in zip(rows, plans)]
    scorer = TokenScorer(model, head, with_entropy=False)
    spec = LossSpec()

    def packed_pass():
        for row, plan in packed:
            t = row.tensors
            inputs = LossInputs(proximal_logprobs=t["sampler_logprobs"], advantages=t["advantages"], mask=t["mask"],
                                document_index=t["document_index"], documents=row.documents)
            head_loss = functools.partial(fused_micro_batch_loss, labels=t["labels"], inputs=inputs,
                                          totals=plan.totals, spec=spec, head=head, labelled=row.labelled)
            loss, _ = scorer(t["input_ids"], t["position_ids"], t["labels"], head_loss=head_loss, documents=row.packed)
            loss.backward()
        model.zero_grad(set_to_none=True)

    return packed_pass, len(packed)


def _padded_pass(padded, model, head_dtype) -> Callable[[], None]:
    """The usual loop over right-padded batches: full logits, log-softmax, gather, the same loss."""

    def padded_pass():
        for input_ids, attention, labels, old, adv in padded:
            hidden = model.base_model(input_ids=input_ids, attention_mask=attention, use_cache=False).last_hidden_state
            weight = model.get_output_embeddings().weight  # [V, H]
            logits = hidden.to(head_dtype) @ weight.to(head_dtype).T  # [B, L, V], the head in the packed path's dtype
            log_p = torch.log_softmax(logits.float(), dim=-1)
            valid = labels >= 0
            lp = torch.where(valid, log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
            mask = valid.float()
            ratio = torch.exp(lp - old)
            per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            loss = (per_token * mask).sum() / mask.sum()
            loss.backward()
        model.zero_grad(set_to_none=True)

    return padded_pass


def loops(args) -> Loops:
    """Build the rollouts, the model and the two pass callables of ``args`` (``_parse``'s namespace)."""
    from rlcli.modules import HeadSpec

    device = torch.device(args.device)
    rollouts = _rollouts(args)
    real_tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    model, attn_implementation = _model(args, device)
    fp32_head = device.type == "cuda"  # bfloat16 model, float32 head and softmax
    head = HeadSpec(fp32=fp32_head, chunk_tokens=args.chunk_tokens)
    packed_pass, rows = _packed_pass(rollouts, model, head, device, args.max_tokens)
    batch_size = args.batch_size or max(1, round(len(rollouts) / rows))
    padded = [_padded_batch(rollouts[i : i + batch_size], device) for i in range(0, len(rollouts), batch_size)]
    head_dtype = torch.float32 if fp32_head else next(model.parameters()).dtype
    info = dict(documents=len(rollouts), real_tokens=real_tokens, completion_range=[args.min_completion,
                args.max_completion], packed_micro_batches=rows, padded_batches=len(padded),
                padded_batch_size=batch_size, padded_tokens_incl_padding=sum(b[0].numel() for b in padded),
                model=model_sizes(args), chunk_tokens=args.chunk_tokens,
                device=str(device), device_name=device_name(device), attention=attn_implementation,
                dtype="bfloat16, fp32 head" if fp32_head else "float32")
    return Loops(packed=packed_pass, padded=_padded_pass(padded, model, head_dtype), info=info)


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = device_sync(device)
    built = loops(args)
    result = built.info | dict(threads=torch.get_num_threads())
    passes = {"packed": built.packed, "padded": built.padded}
    times = time_in_turns(passes, args.repeats, time.perf_counter, sync)
    for name in passes:
        result[f"{name}_s"] = statistics.median(times[name])
        result[f"{name}_tokens_per_s"] = result["real_tokens"] / statistics.median(times[name])
    # the median of the ratios of passes made one after the other
    result["speedup"] = statistics.median(b / a for a, b in zip(times["packed"], times["padded"]))
    return result


def format_table(r: dict) -> str:
    return "\n".join([
        f"{r['documents']} rollouts, completions {r['completion_range'][0]}..{r['completion_range'][1]} tokens, "
        f"{r['real_tokens']} real tokens; tiny Llama H={r['model']['hidden']} layers={r['model']['layers']} "
        f"heads={r['model']['heads']} "
        f"V={r['model']['vocab']} in {r['dtype']}, attention {r['attention']}, on {r['device_name']} "
        f"({r['threads']} threads); median pass",
        "",
        "| loop | forwards | tokens incl. padding | pass (s) | real tokens/s |",
        "|---|---:|---:|---:|---:|",
        f"| packed (pack_documents + TokenScorer, chunk_tokens={r['chunk_tokens']}) | {r['packed_micro_batches']} "
        f"| {r['real_tokens']} | {r['packed_s']:.3g} | {r['packed_tokens_per_s']:.0f} |",
        f"| padded ({r['padded_batch_size']} docs/batch, attention_mask, full logits) | {r['padded_batches']} "
        f"| {r['padded_tokens_incl_padding']} | {r['padded_s']:.3g} | {r['padded_tokens_per_s']:.0f} |",
        "",
        f"packed / padded throughput: {r['speedup']:.2f}×",
    ])


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    result = run(args)
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
