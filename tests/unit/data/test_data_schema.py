"""validate_record builds the right Rollout from a valid record (the broken rules are in test_data_readers)."""

import pytest

from rlcli.data.schema import RecordError, Rollout, validate_record

VOCAB = 50


def validate(raw, max_tokens=None):
    return validate_record(raw, source="f.jsonl:7", index=4, vocab_size=VOCAB, max_tokens=max_tokens)


def test_valid_record_becomes_rollout(record):
    rollout = validate(record(completion_mask=[1, 0], temperature=0.7, old_logprobs=[-0.5, 0]))
    assert rollout == Rollout(
        prompt_ids=(1, 2, 3),
        completion_ids=(4, 5),
        old_logprobs=(-0.5, 0.0),
        advantages=None,
        reward=1.0,
        group_id="g0",
        completion_mask=(1, 0),
        temperature=0.7,
        source="f.jsonl:7",
        index=4,
    )
    assert rollout.num_tokens == 5
    assert rollout.num_labelled == 1
    assert all(type(v) is float for v in rollout.old_logprobs)  # an int 0 is read as 0.0


def test_defaults_when_optional_fields_absent(record):
    rollout = validate(record(drop=("group_id",), advantages=[0.5, -1]))
    assert rollout.completion_mask == (1, 1)
    assert rollout.group_id is None and rollout.temperature is None
    assert rollout.advantages == (0.5, -1.0)


def test_scalar_advantage_is_expanded_to_every_completion_token(record):
    rollout = validate(record(completion_ids=[4, 5, 6], old_logprobs=[-1, -1, -1], advantage=-0.25))
    assert rollout.advantages == (-0.25, -0.25, -0.25)


def test_null_counts_as_absent_and_extra_fields_are_ignored(record):
    raw = record(advantage=None, advantages=[1.0, 2.0], temperature=None, sampler_step=12, text="hi")
    rollout = validate(raw)
    assert rollout.advantages == (1.0, 2.0)
    assert rollout.temperature is None


def test_boolean_mask_values_are_accepted(record):
    assert validate(record(completion_mask=[True, False])).completion_mask == (1, 0)


def test_int_group_id_and_token_at_vocab_edge(record):
    rollout = validate(record(group_id=3, prompt_ids=[0, VOCAB - 1]))
    assert rollout.group_id == 3
    assert rollout.prompt_ids == (0, VOCAB - 1)


def test_max_tokens_exactly_fits_and_one_over_is_rejected(record):
    assert validate(record(), max_tokens=5).num_tokens == 5
    with pytest.raises(RecordError) as info:
        validate(record(), max_tokens=4)
    assert info.value.field == "completion_ids"
    assert "5 tokens" in info.value.reason and "data.max_tokens=4" in info.value.reason


def test_record_error_message_format():
    err = RecordError("a.jsonl:3", "reward", "missing (required)")
    assert str(err) == "a.jsonl:3: field 'reward': missing (required)"
    assert isinstance(err, ValueError)
    assert str(RecordError("a.jsonl:4", None, "invalid JSON")) == "a.jsonl:4: invalid JSON"


def test_first_broken_field_is_reported(record):
    with pytest.raises(RecordError) as info:
        validate(record(prompt_ids=[], reward="x"))
    assert info.value.field == "prompt_ids"


def test_with_advantages_returns_a_copy(record):
    rollout = validate(record())
    updated = rollout.with_advantages([1, 2])
    assert updated.advantages == (1.0, 2.0)
    assert rollout.advantages is None
    assert updated.source == rollout.source and updated.index == rollout.index
    with pytest.raises(ValueError, match="f.jsonl:7"):
        rollout.with_advantages([1.0])


def test_ref_logprobs_are_read_when_given_and_follow_the_log_probability_rules(record):
    assert validate(record()).ref_logprobs is None
    assert validate(record(ref_logprobs=[-0.25, 0])).ref_logprobs == (-0.25, 0.0)
    for bad, reason in [([-0.1], "has 1 values but completion_ids has 2"), ([-0.1, 0.5], "element 1 is 0.5"),
                        ([-0.1, float("nan")], "element 1 is nan"), ("x", "expected a list of numbers")]:
        with pytest.raises(RecordError, match="ref_logprobs") as error:
            validate(record(ref_logprobs=bad))
        assert reason in str(error.value)


def test_micro_batches_carry_ref_logprobs_at_the_label_positions(record):
    from rlcli.data.packing import make_micro_batch

    docs = [validate(record(ref_logprobs=[-0.25, -0.5], completion_mask=[1, 0])).with_advantages([1.0, 1.0]),
            validate(record(ref_logprobs=[-1.5, -2.0])).with_advantages([1.0, 1.0])]
    batch = make_micro_batch(docs)
    # prompt [1,2,3] + completion [4,5]: positions 2, 3 predict the completion; the second token is masked out
    assert batch.reference_logprobs.tolist() == [0, 0, -0.25, 0, 0] + [0, 0, -1.5, -2.0, 0]
    assert batch.proximal_logprobs is None
    assert make_micro_batch(docs[:1] + [validate(record()).with_advantages([1.0, 1.0])]).reference_logprobs is None


def test_log_probs_and_advantages_are_bounded_by_the_float32_range_they_are_trained_in(record):
    import math

    import torch

    from rlcli.data.packing import make_micro_batch
    from rlcli.data.schema import FLOAT32_MAX

    assert FLOAT32_MAX == torch.finfo(torch.float32).max
    # float64 values from halfway between FLOAT32_MAX and 2**128 on become infinite as float32 (those below
    # it round to FLOAT32_MAX); the rule rejects everything beyond FLOAT32_MAX, the float32 range.
    halfway = float.fromhex("0x1.ffffffp+127")
    assert torch.tensor([FLOAT32_MAX, halfway], dtype=torch.float64).float().isinf().tolist() == [False, True]
    above = math.nextafter(FLOAT32_MAX, math.inf)
    # The largest accepted values stay finite in the micro-batch's float32 tensors.
    edge = validate(record(old_logprobs=[-FLOAT32_MAX, -1.0], ref_logprobs=[-1.0, -FLOAT32_MAX],
                           advantages=[FLOAT32_MAX, -FLOAT32_MAX]))
    batch = make_micro_batch([edge])
    for tensor in (batch.sampler_logprobs, batch.reference_logprobs, batch.advantages):
        assert tensor.dtype == torch.float32 and tensor.isfinite().all() and tensor.abs().max() == FLOAT32_MAX
    for field, value in [("old_logprobs", [-above, -1.0]), ("ref_logprobs", [-1.0, -above]),
                         ("advantages", [0.0, above]), ("advantage", -above)]:
        with pytest.raises(RecordError) as error:
            validate(record(**{field: value}))
        assert error.value.field == field and "outside the float32 range" in error.value.reason
    # reward and temperature never become tensors: any finite float64 is fine.
    assert validate(record(reward=-1e300, temperature=1e300)).reward == -1e300
