"""On-policy distillation at the trainer's batch stage (math.md#on-policy-distillation): each labelled token's
advantage gains coef x (teacher's − trainer's log-prob), both by the chunked head at the loss temperature.

Every number is checked against tests/unit/modules/distill_reference.py: float64 copies of the models, each
document alone, full logits. A wrong temperature, the sampler's log-probs in place of the trainer's, a
missing or doubled coef, or a reference taken for the teacher each break the advantage test; a wrong sign
or a term that does not reach the loss breaks the gradient test.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from distill_reference import float64_copy, ref_completion_logprobs, ref_distill_advantages, ref_reverse_kl

from factories import tiny_policy
from rlcli.conf.validate import ConfigError, validate_config
from rlcli.data.packing import make_micro_batch
from rlcli.data.schema import validate_record
from rlcli.errors import UserError
from rlcli.training.batches import BatchPlan
from rlcli.training.distill import add_distill_advantages
from rlcli.training.logprobs import add_trainer_logprobs
from rlcli.training.loss import MicroBatchLoss, micro_batch_to_device
from rlcli.training.module import PolicyModule
from rlcli.training.plan import plan_update
from train_helpers import compose_train_config

VOCAB = 48
TEMPERATURE = 0.7
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models():
    student = tiny_policy(VOCAB, hidden_size=32, num_heads=2, seed=0)
    teacher = tiny_policy(VOCAB, hidden_size=48, num_heads=4, num_layers=1, seed=1)
    return student, teacher


def make_documents(seed: int = 0, count: int = 9):
    """Documents of 3 groups with random tokens, per-token reward advantages and some masked tokens."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        n = rng.randint(1, 6)
        mask = [int(rng.random() > 0.25) for _ in range(n)]
        record = dict(prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))],
                      completion_ids=[rng.randrange(VOCAB) for _ in range(n)],
                      old_logprobs=[-rng.uniform(0.1, 5) for _ in range(n)],
                      advantages=[rng.uniform(-1, 1) for _ in range(n)], completion_mask=mask, group_id=i % 3)
        docs.append(validate_record(record, source=f"doc {i}", index=i, vocab_size=VOCAB))
    return docs


def batch_loss(*overrides: str) -> MicroBatchLoss:
    typed = validate_config(compose_train_config([f"loss.temperature={TEMPERATURE}", "loss.chunk_tokens=7",
                                                  *overrides]))
    return MicroBatchLoss(typed.loss, typed.aggregation, typed.metrics.level, typed.kl, typed.correction)


def distilled(docs, pieces, loss, student, teacher, coef, reference=None) -> BatchPlan:
    """A one-update batch of ``docs`` split into the micro-batches ``pieces`` (lists of indices), after the
    batch stage: the trainer's log-probs, then the distillation term."""
    micro_batches = [make_micro_batch([docs[i] for i in piece]) for piece in pieces]
    plan = BatchPlan(micro_batches, minibatches=1, epochs=1, seed=0, batch=0, max_tokens=10**6)
    add_trainer_logprobs(plan, loss, CPU, policy=loss.scorer(student), reference=reference, teacher=teacher)
    add_distill_advantages(plan, coef, CPU)
    return plan


def references(docs, student, teacher):
    """Each document's float64 (teacher, student) completion log-probs."""
    student64, teacher64 = float64_copy(student), float64_copy(teacher)
    with torch.no_grad():
        return [(ref_completion_logprobs(teacher64, list(d.prompt_ids), list(d.completion_ids), TEMPERATURE),
                 ref_completion_logprobs(student64, list(d.prompt_ids), list(d.completion_ids), TEMPERATURE))
                for d in docs]


@pytest.mark.parametrize("old_logprobs, coef", [("recompute", 1.0), ("sampler", 0.5), ("recompute", 2.5)])
def test_advantages_and_reverse_kl_equal_the_float64_reference(models, old_logprobs, coef):
    """With loss.old_logprobs=sampler too, the student's log-probs are the trainer's, not the records'."""
    student, teacher = models
    docs = make_documents()
    loss = batch_loss(f"loss.old_logprobs={old_logprobs}")
    plan = distilled(docs, [[0, 1, 2, 3], [4, 5, 6, 7, 8]], loss, student, loss.scorer(teacher), coef)
    refs = references(docs, student, teacher)
    by_index = {d.index: d for d in plan.documents}
    for doc, (tlp, slp) in zip(docs, refs):
        want = ref_distill_advantages(list(doc.advantages), tlp, slp, list(doc.completion_mask), coef)
        assert by_index[doc.index].advantages == pytest.approx(want, abs=2e-5), doc.source
    want_kl = ref_reverse_kl([t for t, _ in refs], [s for _, s in refs], [list(d.completion_mask) for d in docs])
    assert plan.stats["distill/reverse_kl"] == pytest.approx(want_kl, abs=1e-5)
    assert abs(want_kl) > 1e-3  # the two models differ: the term is not 0


def test_the_step_gradient_with_those_advantages_equals_the_float64_reference(models):
    """grpo, token_mean, at the batch's start (ratio 1): grad L = -(1/T) sum_t m_t A_t grad lp_t."""
    student, teacher = models
    docs = make_documents(seed=1)
    loss = batch_loss("loss.old_logprobs=recompute")
    plan = distilled(docs, [[0, 1, 2], [3, 4, 5, 6, 7, 8]], loss, student, loss.scorer(teacher), 0.8)
    update = plan.next_update()
    totals = plan_update(update.micro_batches, CPU)
    scorer = loss.scorer(student)
    scorer.zero_grad()
    for micro_batch in update.micro_batches:
        loss.loss(scorer, micro_batch_to_device(micro_batch, totals.group_numbering, CPU), totals)[0].backward()

    student64, teacher64 = float64_copy(student), float64_copy(teacher)
    labelled = sum(d.num_labelled for d in docs)
    ref_loss = torch.zeros((), dtype=torch.float64)
    for doc in docs:
        lp = ref_completion_logprobs(student64, list(doc.prompt_ids), list(doc.completion_ids), TEMPERATURE)
        with torch.no_grad():
            tlp = ref_completion_logprobs(teacher64, list(doc.prompt_ids), list(doc.completion_ids), TEMPERATURE)
        advantages = ref_distill_advantages(list(doc.advantages), tlp, lp, list(doc.completion_mask), 0.8)
        ratio = torch.exp(lp - lp.detach())
        mask = torch.tensor(doc.completion_mask, dtype=torch.float64)
        ref_loss = ref_loss - (mask * torch.tensor(advantages, dtype=torch.float64) * ratio).sum() / labelled
    ref_loss.backward()
    got = dict(student.named_parameters())
    for name, param in student64.named_parameters():
        scale = param.grad.abs().max().item()
        assert (got[name].grad.to(torch.float64) - param.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name


def test_random_splits_into_1_to_8_micro_batches_give_the_same_advantages_and_metric(models):
    student, teacher = models
    docs = make_documents(seed=2, count=12)
    loss = batch_loss()
    teacher_scorer = loss.scorer(teacher)
    whole = distilled(docs, [list(range(len(docs)))], loss, student, teacher_scorer, 1.0)
    want = {d.index: d.advantages for d in whole.documents}
    rng = random.Random(0)
    for parts in range(1, 9):
        order = rng.sample(range(len(docs)), len(docs))
        cuts = sorted(rng.sample(range(1, len(docs)), parts - 1))
        pieces = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(docs)])]
        split = distilled(docs, pieces, loss, student, teacher_scorer, 1.0)
        for doc in split.documents:
            # the float32 log-probs (about 4 in size, a unit in the last place 4.8e-7) of other micro-batches differ
            # by a few units: so do the advantages and the KL, made of their differences
            assert doc.advantages == pytest.approx(want[doc.index], abs=5e-6), (parts, doc.source)
        assert split.stats["distill/reverse_kl"] == pytest.approx(whole.stats["distill/reverse_kl"], abs=5e-6)


def test_a_teacher_that_is_the_reference_runs_one_forward_for_both(models):
    """One model object, one forward per micro-batch, and ref_logprobs the teacher's bit for bit."""
    student, teacher = models
    docs = make_documents(seed=3)
    loss = batch_loss()
    shared = loss.scorer(teacher)
    calls = []
    hook = teacher.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        plan = distilled(docs, [[0, 1, 2], [3, 4], [5, 6, 7, 8]], loss, student, shared, 1.0, reference=shared)
    finally:
        hook.remove()
    assert len(calls) == 3
    assert all(d.ref_logprobs == d.teacher_logprobs for d in plan.documents)
    assert any(any(v != 0 for v in d.teacher_logprobs) for d in plan.documents)


def test_a_resumed_batch_holds_the_term_once(models):
    """The checkpoint's batch state holds the distilled advantages; restoring it adds nothing."""
    student, teacher = models
    docs = make_documents(seed=4)
    loss = batch_loss()
    plan = distilled(docs, [[0, 1, 2, 3, 4, 5, 6, 7, 8]], loss, student, loss.scorer(teacher), 1.0)
    resumed = BatchPlan.from_state(plan.state_dict(), minibatches=1, epochs=1, seed=0, max_tokens=10**6)
    assert [d.advantages for d in resumed.documents] == [d.advantages for d in plan.documents]
    assert [d.advantages for d in resumed.documents] != [d.advantages for d in docs]
    assert resumed.stats == plan.stats


# building the teacher


def save_model(directory: Path, vocab_size: int, seed: int) -> Path:
    tiny_policy(vocab_size, hidden_size=32, num_heads=2, seed=seed).save_pretrained(directory)
    return directory


def test_a_teacher_with_another_vocabulary_is_an_error_naming_both(tmp_path):
    from rlcli.build import build_teacher

    teacher = save_model(tmp_path / "teacher", 40, seed=1)
    typed = validate_config(compose_train_config(["advantage.estimator=distill", f"teacher.path={teacher}"]))
    with pytest.raises(UserError) as info:
        build_teacher(typed, tiny_policy(VOCAB), None)
    message = str(info.value)
    assert message.startswith("teacher.path:")
    assert all(part in message for part in (str(teacher), "40", str(VOCAB), "model=tiny"))


def test_a_bad_kl_reference_is_named_as_kl_reference_not_model_path(tmp_path):
    """Before the fix both messages began with "model.path:", the key of the policy the user had right."""
    from rlcli.build import build_reference

    typed = validate_config(compose_train_config(["kl.coef=0.1", f"kl.reference={tmp_path / 'missing'}"]))
    with pytest.raises(UserError) as info:
        build_reference(typed, tiny_policy(VOCAB))
    assert str(info.value).startswith(f"kl.reference: {tmp_path / 'missing'} is not a Hugging Face checkpoint")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    typed = validate_config(compose_train_config(["kl.coef=0.1", f"kl.reference={tmp_path / 'broken'}"]))
    with pytest.raises(UserError, match=rf"^kl\.reference: cannot load {tmp_path / 'broken'}: "):
        build_reference(typed, tiny_policy(VOCAB))


def test_kl_reference_at_the_teacher_path_is_the_same_model(tmp_path, monkeypatch):
    from rlcli.build import build_reference, build_teacher

    teacher = save_model(tmp_path / "teacher", VOCAB, seed=1)
    monkeypatch.chdir(tmp_path)
    typed = validate_config(compose_train_config(["advantage.estimator=distill", "teacher.path=teacher/",
                                                  "kl.coef=0.1", f"kl.reference={teacher}"]))
    policy = tiny_policy(VOCAB)
    reference = build_reference(typed, policy)
    shared = build_teacher(typed, policy, reference)
    assert shared is reference
    loss = MicroBatchLoss(typed.loss, typed.aggregation, typed.metrics.level, typed.kl, typed.correction)
    module = PolicyModule(policy, loss, typed.trainer, None, None, seed=0, max_tokens=64, reference=reference,
                          teacher=shared, distill_coef=1.0)
    assert module.teacher is module.reference  # one scorer: add_trainer_logprobs runs one forward for both
    other = validate_config(compose_train_config(["advantage.estimator=distill", f"teacher.path={teacher}",
                                                  "kl.coef=0.1"]))  # kl.reference=initial: two models
    assert build_teacher(other, policy, build_reference(other, policy)) is not None


# the config


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(compose_train_config(overrides))
    return info.value.problems


def test_distill_needs_a_teacher_and_a_teacher_needs_distill(tmp_path):
    teacher = save_model(tmp_path / "teacher", VOCAB, seed=1)
    assert any(p.startswith("teacher.path: is required for advantage.estimator=distill")
               for p in problems_of(["advantage.estimator=distill"]))
    assert any(p.startswith("teacher.path: only valid with advantage.estimator=distill")
               for p in problems_of([f"teacher.path={teacher}"]))
    assert any("not a Hugging Face checkpoint directory" in p
               for p in problems_of(["advantage.estimator=distill", f"teacher.path={tmp_path}"]))
    assert any(p.startswith("teacher.path: a teacher runs whole in every process")
               for p in problems_of(["advantage.estimator=distill", f"teacher.path={teacher}", "strategy=fsdp2",
                                     "data=rollouts"]))


def test_distill_rewards_passk_reads_advantage_k(tmp_path):
    teacher = save_model(tmp_path / "teacher", VOCAB, seed=1)
    distill = ["advantage.estimator=distill", f"teacher.path={teacher}"]
    assert any(p.startswith("advantage.k: is required for distill.rewards=passk")
               for p in problems_of([*distill, "distill.rewards=passk"]))
    typed = validate_config(compose_train_config([*distill, "distill.rewards=passk", "advantage.k=2"]))
    assert typed.distill.rewards == "passk"


# the rewards' part, where the advantages are computed


@pytest.mark.parametrize("rewards", ["none", "grpo", "rloo"])
def test_rollout_files_get_the_rewards_part_of_distill_rewards(tmp_path, rewards):
    """At read, distill.rewards is the estimator of the rewards (none: 0); a record that carries advantages
    keeps them. The reference group advantages are written from the formulas of math.md#advantages."""
    from factories import rollout_record, write_jsonl
    from rlcli.training.sources.files import RolloutsKind

    records = [rollout_record(g, completion_len=2 + g % 3, reward=float(g * g % 5)) for g in range(8)]
    records[0]["advantages"] = [0.25] * 2
    data = write_jsonl(tmp_path / "rollouts.jsonl", records)
    teacher = save_model(tmp_path / "teacher", VOCAB, seed=1)
    typed = validate_config(compose_train_config(["data=rollouts", f"data.paths=[{data}]",
                                                  "advantage.estimator=distill", f"teacher.path={teacher}",
                                                  f"distill.rewards={rewards}"]))
    got = {doc.index: doc.advantages for doc in RolloutsKind(typed, tmp_path).read(64)}
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(records[1:], start=1):
        groups.setdefault(r["group_id"], []).append(i)
    want = {0: (0.25, 0.25)}
    for members in groups.values():
        rs = [records[i]["reward"] for i in members]
        mean = sum(rs) / len(rs)
        std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
        for i, r in zip(members, rs):
            value = {"none": 0.0, "grpo": (r - mean) / (std + typed.advantage.eps) if std else 0.0,
                     "rloo": (r - (sum(rs) - r) / (len(rs) - 1)) if len(rs) > 1 else 0.0}[rewards]
            want[i] = (value,) * len(records[i]["completion_ids"])
    for i, values in want.items():
        assert got[i] == pytest.approx(values, abs=1e-12), (rewards, i)
    assert rewards == "none" or any(v[0] != 0 for i, v in got.items() if i)
