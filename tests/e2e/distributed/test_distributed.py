"""math.md#aggregation, #step-size on 2 CPU processes (gloo): one step on 2 ranks equals the whole step computed in
float64 by one process, with DDP and FSDP2, docs_per_step loses and repeats nothing, and an FSDP2 run resumes
exactly."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
from launch import run_ranks
from transformers import AutoModelForCausalLM

from factories import initial_policy, rollout_record, tiny_policy, write_jsonl
from rlcli.data.packing import make_micro_batch
from rlcli.data.readers import load_rollouts
from rlcli.model.scorer import TokenScorer
from rlcli.modules import Correction, HeadSpec, KLPenalty, LossInputs, LossSpec, PolicyLoss, make_loss, policy_loss
from rlcli.rollout.advantages import apply_advantage_estimator
from train_helpers import compose_train_config, run_rlcli

pytestmark = pytest.mark.slow

LOSSES = ["grpo", "gspo"]
AGGREGATIONS = [("token_mean", None), ("sample_mean", None), ("prompt_mean", None), ("constant", 6.0)]
DOCS_PER_STEP = 9
LR = 0.5
# the loss family's terms, as config overrides and as the arguments of the float64 whole step
TERM_OVERRIDES = ["kl.coef=0.05", "kl.reference=rollouts", "kl.ratio_weighted=true", "loss.entropy_coef=0.01",
                  "correction.mode=truncate", "correction.high=1.5"]
TERM_ARGUMENTS = dict(kl=KLPenalty(coef=0.05, ratio_weighted=True), entropy_coef=0.01,
                      correction=Correction(mode="truncate", high=1.5))
# the dual clip's c (math.md#dual-clip) on ratios around 1.2 (`raised_ratio_rollouts`): it caps some tokens, not all
DUAL_CLIP = 1.2
# correction.mode=reject (math.md#mismatch-correction) at each level, with bounds that reject some of the first
# step's tokens or documents of `spread_rollouts` and keep some (the tiny model's ratios to the records' are 0.02
# to 3.8 per token, median 0.53; 0.17 to 2.2 as a document's geometric mean, 0.001 to 4.8 as its product)
REJECT_CASES = [("grpo", "token_mean", "token", 0.75, 1.15), ("gspo", "sample_mean", "sequence", 0.05, 2.0),
                ("grpo", "prompt_mean", "geometric", 0.5, 2.0)]
DISTILL_COEF = 0.7  # advantage.estimator=distill's distill.coef, with distill.rewards=grpo


@functools.cache
def default_config():
    """`rlcli train`'s default config, composed once: Hydra takes about 0.1 s a time, most of a reference step."""
    return compose_train_config()


def two_rank_overrides(data, strategy, *extra):
    return ["data=rollouts", f"data.paths=[{data}]", f"strategy={strategy}", "trainer.devices=2",
            "trainer.accelerator=cpu", "logger=none", *extra]


def reference_parameters(data, docs: list[int], loss: str | PolicyLoss, aggregation: str, divisor,
                         terms: bool = False, teacher: str | None = None, reject: tuple | None = None) -> dict:
    """One SGD step on ``docs`` as one float64 micro-batch in one process (no split at all); with ``terms``
    the KL penalty to the records' ref_logprobs, the entropy bonus and the mismatch correction too (the
    proximal log-probs of a first step are the current ones); with ``teacher`` (a checkpoint's directory),
    on-policy distillation's advantages ``A + DISTILL_COEF (tlp - sg(lp))`` (math.md#on-policy-distillation);
    with ``reject = (level, low, high)`` the mismatch correction's reject mode alone."""
    cfg = default_config()
    policy = initial_policy(cfg).double()
    rollouts, _ = load_rollouts([data], vocab_size=policy.config.vocab_size)
    by_index = {r.index: r for r in apply_advantage_estimator(rollouts, "grpo", eps=cfg.advantage.eps)}
    batch = make_micro_batch([by_index[i] for i in docs])
    scorer = TokenScorer(policy, HeadSpec(chunk_tokens=0), with_entropy=terms)
    logprobs, entropy = scorer(batch.input_ids, batch.position_ids, batch.labels)
    advantages = batch.advantages.double()
    if teacher is not None:
        with torch.no_grad():
            teacher_model = AutoModelForCausalLM.from_pretrained(teacher, torch_dtype=torch.float64)
            tlp, _ = TokenScorer(teacher_model, HeadSpec(chunk_tokens=0), with_entropy=False)(
                batch.input_ids, batch.position_ids, batch.labels)
        advantages = advantages + DISTILL_COEF * torch.where(batch.mask > 0, tlp - logprobs.detach(), 0.0)
    numbering = {g: i for i, g in enumerate(dict.fromkeys(d.group_id for d in batch.documents))}
    corrected = terms or reject is not None
    inputs = LossInputs(
        proximal_logprobs=logprobs.detach() if corrected else batch.sampler_logprobs.double(),
        advantages=advantages, mask=batch.mask.double(), document_index=batch.document_index,
        group_index=batch.group_index(numbering),
        reference_logprobs=batch.reference_logprobs.double() if terms else None,
        sampler_logprobs=batch.sampler_logprobs.double() if corrected else None,
    )
    arguments = TERM_ARGUMENTS if terms else {}
    if reject is not None:
        level, low, high = reject
        arguments = {"correction": Correction(mode="reject", level=level, low=low, high=high)}
    spec = LossSpec(loss, aggregation=aggregation, divisor=divisor, **arguments)
    step_loss, _ = policy_loss(logprobs, inputs, spec, entropy=entropy)
    step_loss.backward()
    with torch.no_grad():
        return {name: p - LR * p.grad for name, p in policy.named_parameters()}, {
            name: p.detach().clone() for name, p in policy.named_parameters()
        }


def first_step_documents(out, name) -> list[int]:
    ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]
    return sorted(i for rank in ranks for batch in rank[0] for i in batch)


@pytest.fixture(scope="module")
def spread_rollouts(tmp_path_factory):
    """24 documents in 6 groups of different lengths and rewards."""
    path = tmp_path_factory.mktemp("data") / "rollouts.jsonl"
    rng = random.Random(3)
    records = [rollout_record(g, prompt_len=rng.randint(2, 5), completion_len=rng.randint(2, 9)) for g in range(24)]
    for i, r in enumerate(records):
        r["group_id"] = i % 6
        r["reward"] = rng.random()
        r["ref_logprobs"] = [lp - rng.random() for lp in r["old_logprobs"]]
    return write_jsonl(path, records)


@pytest.fixture(scope="module")
def raised_ratio_rollouts(spread_rollouts, tmp_path_factory):
    """``spread_rollouts`` with the sampler's log-probs lowered by 0.8: the first step's ratios lie around 1.2
    (median per token)."""
    records = [json.loads(line) for line in spread_rollouts.read_text().splitlines()]
    for r in records:
        r["old_logprobs"] = [lp - 0.8 for lp in r["old_logprobs"]]
    return write_jsonl(tmp_path_factory.mktemp("raised") / "rollouts.jsonl", records)


def test_one_step_on_two_ranks_equals_the_float64_whole_step(tmp_path, spread_rollouts, raised_ratio_rollouts):
    rng = random.Random(0)
    jobs = []
    for strategy in ("ddp", "fsdp2"):
        for loss in LOSSES:
            for aggregation, divisor in AGGREGATIONS:
                name = f"{strategy}-{loss}-{aggregation}"
                agg = [f"aggregation={aggregation}"] + ([f"aggregation.divisor={divisor}"] if divisor else [])
                jobs.append({"name": name, "case": (loss, aggregation, divisor), "overrides": two_rank_overrides(
                    spread_rollouts, strategy, f"loss={loss}", *agg, "optimizer=sgd", f"optimizer.lr={LR}",
                    "trainer.grad_clip=0", "trainer.max_steps=1", f"trainer.docs_per_step={DOCS_PER_STEP}",
                    f"data.max_tokens={rng.randint(14, 40)}",  # random micro-batch sizes
                )})
        for loss, (aggregation, divisor) in zip(["cispo", "sapo", "gspo_token", "grpo"], AGGREGATIONS):
            agg = [f"aggregation={aggregation}"] + ([f"aggregation.divisor={divisor}"] if divisor else [])
            jobs.append({"name": f"{strategy}-{loss}-terms", "case": (loss, aggregation, divisor, True),
                         "overrides": two_rank_overrides(
                             spread_rollouts, strategy, f"loss={loss}", *agg, *TERM_OVERRIDES, "optimizer=sgd",
                             f"optimizer.lr={LR}", "trainer.grad_clip=0", "trainer.max_steps=1",
                             f"trainer.docs_per_step={DOCS_PER_STEP}", f"data.max_tokens={rng.randint(14, 40)}",
                         )})
        for loss, aggregation in (("grpo", "token_mean"), ("gspo_token", "sample_mean")):
            jobs.append({"name": f"{strategy}-{loss}-dual_clip", "case": (loss, aggregation, None),
                         "overrides": two_rank_overrides(
                             raised_ratio_rollouts, strategy, f"loss={loss}", f"loss.dual_clip={DUAL_CLIP}",
                             f"aggregation={aggregation}", "optimizer=sgd", f"optimizer.lr={LR}", "trainer.grad_clip=0",
                             "trainer.max_steps=1", f"trainer.docs_per_step={DOCS_PER_STEP}",
                             f"data.max_tokens={rng.randint(14, 40)}",
                         )})
        for loss, aggregation, level, low, high in REJECT_CASES:
            jobs.append({"name": f"{strategy}-{loss}-reject-{level}",
                         "case": (loss, aggregation, None, False, None, (level, low, high)),
                         "overrides": two_rank_overrides(
                             spread_rollouts, strategy, f"loss={loss}", f"aggregation={aggregation}",
                             "correction.mode=reject", f"correction.level={level}", f"correction.low={low}",
                             f"correction.high={high}", "optimizer=sgd", f"optimizer.lr={LR}", "trainer.grad_clip=0",
                             "trainer.max_steps=1", f"trainer.docs_per_step={DOCS_PER_STEP}",
                             f"data.max_tokens={rng.randint(14, 40)}",
                         )})
    teacher = tmp_path / "teacher"
    tiny_policy(64, hidden_size=32, num_heads=2, seed=7).save_pretrained(teacher)  # the toy rollouts' vocabulary
    jobs.append({"name": "ddp-grpo-distill", "case": ("grpo", "sample_mean", None, False, str(teacher)),
                 "overrides": two_rank_overrides(
                     spread_rollouts, "ddp", "aggregation=sample_mean", "advantage.estimator=distill",
                     f"teacher.path={teacher}", "distill.rewards=grpo", f"distill.coef={DISTILL_COEF}",
                     "optimizer=sgd", f"optimizer.lr={LR}", "trainer.grad_clip=0", "trainer.max_steps=1",
                     f"trainer.docs_per_step={DOCS_PER_STEP}", f"data.max_tokens={rng.randint(14, 40)}",
                 )})
    run_ranks(jobs, tmp_path)
    for job in jobs:
        docs = first_step_documents(tmp_path, job["name"])
        assert len(docs) >= DOCS_PER_STEP
        data, case = spread_rollouts, job["case"]
        if job["name"].endswith("dual_clip"):
            data, case = raised_ratio_rollouts, (make_loss(case[0], dual_clip=DUAL_CLIP), *case[1:])
            header, row = (tmp_path / job["name"] / "metrics.csv").read_text().splitlines()
            assert float(row.split(",")[header.split(",").index("dual_clipped_fraction")]) > 0, job["name"]  # it acts
        if "-reject-" in job["name"]:  # it rejects some tokens and keeps some
            header, row = (tmp_path / job["name"] / "metrics.csv").read_text().splitlines()
            assert 0 < float(row.split(",")[header.split(",").index("is_rejected_fraction")]) < 1, job["name"]
        expected, initial = reference_parameters(data, docs, *case)
        actual = torch.load(tmp_path / f"{job['name']}.pt")
        update_error = sum((actual[k].double() - expected[k]).norm() ** 2 for k in expected) ** 0.5
        update_size = sum((expected[k] - initial[k]).norm() ** 2 for k in expected) ** 0.5
        param_size = sum(expected[k].norm() ** 2 for k in expected) ** 0.5
        assert update_size > 1e-3, job["name"]  # the step really moved the parameters
        assert update_error / param_size <= 1e-5, (job["name"], float(update_error / param_size))
        assert update_error / update_size <= 1e-4, (job["name"], float(update_error / update_size))


def test_docs_per_step_modes_lose_and_repeat_nothing_over_a_run(tmp_path, spread_rollouts):
    common = ["trainer.max_steps=100", "data.max_tokens=25"]
    modes = {
        "exact": ["trainer.docs_per_step=5", "trainer.docs_per_step_mode=exact"],
        "at_least": ["trainer.docs_per_step=5"],
        "static": ["trainer.accumulate_microbatches=2"],
    }
    jobs = [
        {"name": f"{strategy}-{mode}", "mode": mode,
         "overrides": two_rank_overrides(spread_rollouts, strategy, *common, *extra)}
        for strategy in ("ddp", "fsdp2") for mode, extra in modes.items()
    ]
    run_ranks(jobs, tmp_path)
    for job in jobs:
        ranks = [json.loads((tmp_path / f"{job['name']}.rank{r}.json").read_text()) for r in range(2)]
        assert len(ranks[0]) == len(ranks[1])  # the ranks took the same steps
        steps = [[batch for rank in ranks for batch in rank[s]] for s in range(len(ranks[0]))]
        assert steps[-1] == []  # the run ended because every rank ran out of data
        trained = [i for step in steps for batch in step for i in batch]
        assert sorted(trained) == list(range(24)), job["name"]  # every document exactly once
        sizes = [sum(len(b) for b in step) for step in steps[:-1]]
        if job["mode"] == "exact":
            assert sizes[:-1] == [5] * (len(sizes) - 1) and 0 < sizes[-1] <= 5, sizes
        if job["mode"] == "at_least":
            for s in range(len(sizes) - 1):
                last_round = sum(len(rank[s][-1]) for rank in ranks if rank[s])
                assert sizes[s] >= 5 and sizes[s] - last_round < 5, sizes  # the crossing round is kept, no more
        rows = (tmp_path / job["name"] / "metrics.csv").read_text().splitlines()
        assert len(rows) == 1 + len(sizes)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_cli_trains_on_two_cpu_processes(tmp_path, strategy):
    result = run_rlcli(["train", "data=rollouts", "trainer.devices=2", "trainer.accelerator=cpu",
                        f"strategy={strategy}", "trainer.max_steps=2", "trainer.docs_per_step=40"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    [run_dir] = list((tmp_path / "outputs").glob("*/*"))
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and (run_dir / "export" / "model.safetensors").is_file()
    header = rows[0].split(",")
    assert all(float(r.split(",")[header.index("num_documents")]) >= 40 for r in rows[1:])


def test_fsdp2_runs_stopped_and_resumed_equal_their_straight_runs(tmp_path, spread_rollouts):
    """Full fine-tuning with FSDP2, stopped after step 1 and resumed with ``resume=auto``: the metrics and weights
    of steps 2 and 3 equal the straight run's exactly, with AdamW and with SGD without momentum, an optimizer
    with no state (Lightning's loading failed on it with an IndexError); the warmup makes each step's learning
    rate, which the optimizer's param groups hold, differ."""
    common = ["trainer.docs_per_step=6", "data.max_tokens=25", "trainer.checkpoint_every=1", "trainer.grad_clip=0",
              "optimizer.warmup_steps=3", "optimizer.lr=0.05"]
    jobs = []
    for optimizer in ("sgd", "adamw"):
        run = two_rank_overrides(spread_rollouts, "fsdp2", f"optimizer={optimizer}", *common)
        jobs += [{"name": optimizer, "overrides": [*run, "trainer.max_steps=3"]},
                 {"name": f"{optimizer}-resumed", "overrides": [*run, "trainer.max_steps=1"]},
                 {"name": f"{optimizer}-resumed", "overrides": [*run, "trainer.max_steps=3", "resume=auto"]}]
    run_ranks(jobs, tmp_path)
    for optimizer in ("sgd", "adamw"):
        straight, resumed = (tmp_path / name / "metrics.csv" for name in (optimizer, f"{optimizer}-resumed"))
        rows = straight.read_text().splitlines()
        assert len(rows) == 4 and resumed.read_text().splitlines() == rows, optimizer
        header = rows[0].split(",")
        assert len({row.split(",")[header.index("lr")] for row in rows[1:]}) == 3, optimizer  # the warmup
        weights, again = torch.load(tmp_path / f"{optimizer}.pt"), torch.load(tmp_path / f"{optimizer}-resumed.pt")
        assert all(torch.equal(weights[k], again[k]) for k in weights), optimizer
