"""Which rollouts `completions.jsonl` shows: one of each group in turn, hand-derived positions."""

from __future__ import annotations

from rlcli.rollout.completions import pick


def test_one_of_each_group_in_turn_then_the_second_of_each():
    groups = ["a", "a", "b", "b", "c", "c"]
    assert pick(groups, 2) == [0, 2]  # the first of a and b
    assert pick(groups, 4) == [0, 1, 2, 4]  # a, b, c, then a's second
    assert pick(groups, 10) == [0, 1, 2, 3, 4, 5]  # all of them, in order
    assert pick(groups, 0) == []


def test_interleaved_groups_and_documents_without_a_group():
    assert pick([1, 2, 1, 2, 3], 3) == [0, 1, 4]  # group 3 comes before the second of group 1
    assert pick([None, None, None], 2) == [0, 1]  # each its own group: the first two
