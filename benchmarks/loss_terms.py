"""The cost of the loss family's extra passes: a training step with ``loss.old_logprobs=recompute``, one
with a KL penalty to a reference model and one of on-policy distillation, against a plain step on the same
rollouts.

A plain step is the fused head + GRPO loss, forward and backward, over every packed micro-batch (as
`rlcli train` runs it). ``recompute`` adds one no-grad pass of the policy through the same head
(`head_logprobs`) over the batch, which happens once per batch, whatever ``trainer.minibatches``;
``kl`` adds that pass for a frozen copy of the policy (the reference) and the KL term in the loss;
``distill`` (``advantage.estimator=distill``) adds the policy's pass and a teacher's (a frozen model of the
policy's size) and adds ``tlp - prox`` to the advantages. Same synthetic rollouts and tiny model as
`benchmarks.throughput`; the four run in turns, and each
ratio is the median of the ratios of each round. Usage: ``python -m benchmarks.loss_terms [--json PATH]``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.lm_head import chunk_tokens_arg
from benchmarks.machine import device_name
from benchmarks.output import report
from benchmarks.throughput import _model, _rollouts, model_sizes
from benchmarks.timing import device_sync, time_in_turns


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loss_terms", description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=64, help="rollouts per step")
    parser.add_argument("--min-completion", type=int, default=16)
    parser.add_argument("--max-completion", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per packed micro-batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-tokens", type=chunk_tokens_arg, default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each step by this process's CPU time on one thread: on a machine that other jobs "
                             "share, the cost of the step itself (CPU only)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    args.attn = "auto"  # what benchmarks.throughput's model builder reads
    return args


def run(args) -> dict:
    from rlcli.data.document_stream import pack_documents
    from rlcli.model.scorer import TokenScorer
    from rlcli.modules import (
        HeadSpec,
        KLPenalty,
        LossInputs,
        LossSpec,
        Segments,
        StepTotals,
        fused_micro_batch_loss,
        head_logprobs,
    )

    device = torch.device(args.device)
    if args.cpu_time and device.type != "cpu":
        raise SystemExit("--cpu-time: times CPU steps only")
    sync = device_sync(device)
    rows = [[t.to(device) for t in (mb.input_ids, mb.position_ids, mb.labels, mb.sampler_logprobs, mb.advantages,
                                    mb.mask, mb.document_index)]
            for mb in pack_documents(_rollouts(args), args.max_tokens)]
    model, attention = _model(args, device)
    head = HeadSpec(chunk_tokens=args.chunk_tokens)
    plain, with_kl = LossSpec(), LossSpec(kl=KLPenalty(coef=0.05))
    scorer = TokenScorer(model, head, with_entropy=False)
    reference = TokenScorer(copy.deepcopy(model).requires_grad_(False), head, with_entropy=False)
    totals = [StepTotals.of_tokens(mask, Segments.of(doc)) for *_, mask, doc in rows]

    @torch.no_grad()
    def logprobs_pass(of):
        out = []
        for input_ids, position_ids, labels, _, _, mask, doc in rows:
            score = functools.partial(head_logprobs, labels=labels, mask=mask, document_index=doc, spec=plain,
                                      head=head)
            out.append(of(input_ids, position_ids, labels, head_loss=score))
        return out

    def train_pass(reference_logprobs=None, advantages=None):
        for i, (input_ids, position_ids, labels, sampler, adv, mask, doc) in enumerate(rows):
            adv = adv if advantages is None else advantages[i]
            inputs = LossInputs(proximal_logprobs=sampler, advantages=adv, mask=mask, document_index=doc,
                                reference_logprobs=None if reference_logprobs is None else reference_logprobs[i])
            spec = plain if reference_logprobs is None else with_kl
            head_loss = functools.partial(fused_micro_batch_loss, labels=labels, inputs=inputs, totals=totals[i],
                                          spec=spec, head=head)
            loss, _ = scorer(input_ids, position_ids, labels, head_loss=head_loss)
            loss.backward()
        model.zero_grad(set_to_none=True)

    def recompute_step():
        logprobs_pass(scorer)
        train_pass()

    def kl_step():
        train_pass(reference_logprobs=logprobs_pass(reference))

    def distill_step():  # the batch stage of rlcli.training.distill: both passes, then the advantages' term
        advantages = [row[4] + (tlp - prox) for row, prox, tlp in zip(rows, logprobs_pass(scorer),
                                                                        logprobs_pass(teacher))]
        train_pass(advantages=advantages)

    teacher = TokenScorer(copy.deepcopy(model).requires_grad_(False), head, with_entropy=False)
    steps = {"plain": train_pass, "recompute": recompute_step, "kl": kl_step, "distill": distill_step}
    threads = torch.get_num_threads()
    if args.cpu_time:
        torch.set_num_threads(1)
    try:
        times = time_in_turns(steps, args.repeats, time.process_time if args.cpu_time else time.perf_counter, sync)
    finally:
        torch.set_num_threads(threads)
    result = dict(documents=args.documents, micro_batches=len(rows), model=model_sizes(args),
                  chunk_tokens=args.chunk_tokens, attention=attention,
                  device=str(device), device_name=device_name(device),
                  timer="CPU time, one thread" if args.cpu_time else "wall time")
    for name in steps:
        result[f"{name}_s"] = statistics.median(times[name])
    for name in ("recompute", "kl", "distill"):
        result[f"{name}_ratio"] = statistics.median(b / a for a, b in zip(times["plain"], times[name]))
    return result


def format_table(r: dict) -> str:
    return "\n".join([
        f"{r['documents']} rollouts in {r['micro_batches']} packed micro-batches; tiny Llama H={r['model']['hidden']} "
        f"layers={r['model']['layers']} "
        f"heads={r['model']['heads']} V={r['model']['vocab']}, attention {r['attention']}, on {r['device_name']}; "
        f"median step ({r['timer']})",
        "",
        "| step | time (s) | ratio to plain |",
        "|---|---:|---:|",
        f"| plain (fused head + grpo, forward and backward) | {r['plain_s']:.3g} | 1.00 |",
        f"| + recompute (a no-grad pass of the policy for prox_t) | {r['recompute_s']:.3g} "
        f"| {r['recompute_ratio']:.2f} |",
        f"| + KL (a no-grad pass of the reference, the k3 term) | {r['kl_s']:.3g} | {r['kl_ratio']:.2f} |",
        f"| + distill (no-grad passes of the policy and of a teacher of its size) | {r['distill_s']:.3g} "
        f"| {r['distill_ratio']:.2f} |",
    ])


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    result = run(args)
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
