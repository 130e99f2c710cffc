"""Batched sampling: shapes, stops, reproducibility, log-probs equal to a teacher-forced pass,
`HFSampler`, the `Sampler` that wraps it, and the sampler factory (`rlcli.rollout.samplers`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from factories import tiny_policy
from rlcli.errors import UserError
from rlcli.modules.lm_head import HeadSpec, token_logprobs
from rlcli.modules.registry import UnknownName
from rlcli.rollout.sampler import HFSampler, _left_pad, _truncate, sample_completions
from rlcli.rollout.samplers import ENGINES, Samplers, build_sampler

VOCAB = 12
PAD, EOS = 0, 1
PROMPTS = [[2, 3, 4, 5, 6], [7, 8], [9], [3, 3, 10, 11]]  # different lengths: left padding matters


def sample(model, prompts=PROMPTS, *, seed=0, **options):
    settings = dict(max_new_tokens=6, temperature=1.0, stop_ids=(EOS,), pad_id=PAD) | options
    return sample_completions(model, prompts, generator=torch.Generator().manual_seed(seed), **settings)


def teacher_forced_logprobs(model, prompt, completion, temperature):
    """Log-probs of ``completion`` after ``prompt``, one unpadded sequence without a cache: ``[C]``."""
    ids = torch.tensor(prompt + completion)  # [L]
    labels = torch.full_like(ids, -100)
    labels[len(prompt) - 1 : -1] = ids[len(prompt) :]  # position i predicts token i + 1
    with torch.no_grad():
        hidden = model.base_model(
            input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False
        ).last_hidden_state[0]  # [L, H]
        logprobs, _ = token_logprobs(hidden, model.get_output_embeddings().weight, labels, HeadSpec(temperature))
    return logprobs[len(prompt) - 1 : -1]  # [C]


def test_shapes_and_budget():
    model = tiny_policy(VOCAB)
    completions = sample(model, PROMPTS * 4, max_new_tokens=5)
    assert len(completions) == len(PROMPTS) * 4
    for c in completions:
        assert 1 <= len(c.ids) <= 5 and len(c.logprobs) == len(c.ids)
        assert all(0 <= i < VOCAB for i in c.ids) and all(lp <= 0 for lp in c.logprobs)


def test_sequences_stop_at_the_first_stop_token():
    model = tiny_policy(VOCAB)
    stop_ids = (EOS, 4, 5, 6)  # frequent enough that some sequences stop and others run out
    completions = sample(model, PROMPTS * 8, max_new_tokens=6, stop_ids=stop_ids)
    assert {c.stopped for c in completions} == {True, False}
    for c in completions:
        assert not set(c.ids[:-1]) & set(stop_ids)
        assert c.stopped == (c.ids[-1] in stop_ids)
        if not c.stopped:
            assert len(c.ids) == 6
    every_token = sample(model, stop_ids=range(VOCAB))
    assert all(len(c.ids) == 1 and c.stopped for c in every_token)


def test_reproducible_with_a_seed_and_different_with_another():
    model = tiny_policy(VOCAB)
    first = sample(model, seed=3)
    assert sample(model, seed=3) == first
    assert sample(model, seed=4) != first


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 4, 1.0), (0.7, 0, 0.6), (0.7, 5, 0.8)],
)
def test_logprobs_equal_teacher_forced_full_distribution(temperature, top_k, top_p):
    """Batched, left-padded, cached sampling records what the trainer recomputes for each
    sequence alone: the full-vocabulary log-softmax at the same temperature, also under top-k/p.
    Sequences that stopped early (and were then fed padding) do not disturb the others."""
    model = tiny_policy(VOCAB)
    stop_ids = (EOS, 5)
    prompts = PROMPTS * 3
    completions = sample(model, prompts, temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids)
    assert len({len(c.ids) for c in completions}) > 1
    for prompt, c in zip(prompts, completions):
        expected = teacher_forced_logprobs(model, prompt, c.ids, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=1e-4)


def test_top_k_one_is_greedy():
    model = tiny_policy(VOCAB)
    greedy = sample(model, top_k=1, seed=1)
    assert sample(model, top_k=1, seed=2) == greedy
    assert sample(model, top_p=1e-6, seed=3) == greedy


def test_truncation_keeps_the_top_tokens():
    log_p = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()  # [1, 4]
    kept = lambda top_p, top_k: torch.isfinite(_truncate(log_p, top_p, top_k))[0].tolist()
    assert kept(1.0, 0) == [True, True, True, True]
    assert kept(1.0, 2) == [True, True, False, False]
    assert kept(0.45, 0) == [True, False, False, False]
    assert kept(0.6, 0) == [True, True, False, False]
    assert kept(0.9, 0) == [True, True, True, False]
    assert kept(0.99, 0) == [True, True, True, True]
    assert kept(0.9, 1) == [True, False, False, False]
    assert kept(5e-324, 0) == [True, False, False, False]  # 0 as a float32: the top token stays
    shuffled = log_p[:, [2, 0, 3, 1]]  # the nucleus is found whatever the vocabulary order
    assert torch.isfinite(_truncate(shuffled, 0.6, 0))[0].tolist() == [False, True, False, True]


def test_left_padding_positions_start_at_each_prompt():
    input_ids, attention_mask, position_ids = _left_pad([[5, 6, 7], [8]], PAD, torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert position_ids[attention_mask.bool()].tolist() == [0, 1, 2, 0]


@pytest.mark.parametrize("was_training", [True, False])
def test_samples_in_eval_mode_and_restores_the_mode(was_training):
    model = tiny_policy(VOCAB)
    model.train(was_training)
    modes = []
    model.model.register_forward_hook(lambda module, args, output: modes.append(module.training))
    sample(model, max_new_tokens=2)
    assert modes and not any(modes)
    assert model.training == was_training


@pytest.mark.parametrize(
    "options",
    [dict(temperature=0.0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(max_new_tokens=0)],
)
def test_bad_options(options):
    with pytest.raises(ValueError):
        sample(tiny_policy(VOCAB), **options)


@pytest.mark.parametrize("options", [dict(temperature=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_hf_sampler_checks_its_options_when_built(options):
    with pytest.raises(ValueError):
        HFSampler(tiny_policy(VOCAB), **(dict(temperature=1.0) | options))


def test_hf_sampler_is_sample_completions_with_its_options():
    model = tiny_policy(VOCAB)
    sampler = HFSampler(model, temperature=0.7, top_p=0.8, top_k=5)
    assert (sampler.temperature, sampler.vocab_size, sampler.sync_seconds) == (0.7, VOCAB, None)
    generator = torch.Generator().manual_seed(2)
    drawn = sampler.sample(PROMPTS, max_new_tokens=6, stop_ids=(EOS,), pad_id=PAD, generator=generator)
    assert drawn == sample(model, temperature=0.7, top_p=0.8, top_k=5, seed=2)


def test_empty_prompt_is_an_error():
    with pytest.raises(ValueError):
        sample(tiny_policy(VOCAB), [[2], []])


def rollout_options(**changes) -> SimpleNamespace:
    return SimpleNamespace(**(dict(engine="hf", temperature=0.7, top_p=1.0, top_k=0, stop=[], vllm={}) | changes))


TOKENIZER = SimpleNamespace(vocab_size=VOCAB, decode=lambda ids: "".join(chr(97 + i) for i in ids))


def test_the_factory_builds_the_engine_rollout_engine_names():
    assert ENGINES.names() == ("hf", "vllm")
    model = tiny_policy(VOCAB)
    sampler = build_sampler(model, rollout_options(top_k=5), TOKENIZER)
    assert isinstance(sampler, HFSampler) and (sampler.model, sampler.top_k) == (model, 5)
    with pytest.raises(UnknownName, match="unknown rollout.engine 'sglang'; expected one of: hf, vllm"):
        build_sampler(model, rollout_options(engine="sglang"), TOKENIZER)


def test_the_factory_checks_the_vocabulary_once_for_every_engine(tmp_path):
    model = tiny_policy(VOCAB)
    larger = SimpleNamespace(vocab_size=VOCAB + 1, decode=TOKENIZER.decode)
    with pytest.raises(UserError, match=f"task: its tokenizer has {VOCAB + 1} token ids, more than the {VOCAB} of "
                                        "the model$"):
        build_sampler(model, rollout_options(), larger)
    model.save_pretrained(tmp_path / "v0")
    with pytest.raises(UserError, match=f"more than the {VOCAB} of the model at {tmp_path / 'v0'}$"):
        Samplers(rollout_options(), larger).of_checkpoint(tmp_path / "v0")
    with pytest.raises(UserError, match=r"rollout.stop: ids \[12\] are outside the model's vocabulary \(0..11\)"):
        build_sampler(model, rollout_options(stop=[VOCAB]), TOKENIZER)


def test_a_checkpoint_sampler_draws_what_a_sampler_of_the_same_model_draws(tmp_path):
    model = tiny_policy(VOCAB)
    model.save_pretrained(tmp_path / "v0")
    samplers = Samplers(rollout_options(stop=["c"]), TOKENIZER)
    loaded, live = samplers.of_checkpoint(tmp_path / "v0"), samplers.of_policy(model)
    assert loaded.model is not model and not loaded.model.training
    drawn = [s.sample(PROMPTS * 4, max_new_tokens=6, stop_ids=(EOS,), pad_id=PAD,
                      generator=torch.Generator().manual_seed(1)) for s in (loaded, live)]
    assert drawn[0] == drawn[1] and any(c.stopped and c.ids[-1] == 2 for c in drawn[0])  # ended by "c"
    samplers.close()
