"""The lines of ``completions.jsonl``: a few of each step's rollouts, to read what the model wrote
(``rollout.log_completions``, ``data.log_completions``).

`pick` chooses which: one rollout of each group in turn (the first of every group, then the second,
...), so that N lines show N prompts where the step has them; the choice is a pure function of the
step's rollouts, hence the same on a rerun. `text_row` is a rollout whose prompt and task are known
(sampled by rlcli), `ids_row` one read from a rollout file, which holds token ids only.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from rlcli.data.schema import Rollout


def pick(group_ids: Sequence[Hashable | None], n: int) -> list[int]:
    """The positions of ``n`` rollouts (ascending): the first of each group in order, then the second of
    each, and so on; a rollout without a group (None) is a group of its own."""
    seen: dict[Hashable, int] = {}
    ranked = []
    for i, group in enumerate(group_ids):
        key = ("own", i) if group is None else group
        ranked.append((seen.get(key, 0), i))
        seen[key] = seen.get(key, 0) + 1
    return sorted(i for _, i in sorted(ranked)[:n])


def text_row(*, prompt: str, completion: str, rewards: dict[str, float], reward: float, advantage: float,
             length: int, stopped: bool, group_id: str) -> dict[str, Any]:
    """One line for a sampled rollout: the ``prompt``'s text and the decoded ``completion``, each reward
    term's raw value (``{}`` for a task without terms), the reward, the advantage, the completion's tokens and whether
    it ended with a stop token."""
    return {"prompt": prompt, "completion": completion, "rewards": rewards, "reward": reward,
            "advantage": advantage, "length": length, "stopped": stopped, "group_id": group_id}


def ids_row(doc: Rollout) -> dict[str, Any]:
    """One line for a document of a rollout file: its token ids (the file has no text), reward,
    advantage (of its first completion token), length and group, and where it came from."""
    return {"source": doc.name, "prompt_ids": list(doc.prompt_ids), "completion_ids": list(doc.completion_ids),
            "reward": doc.reward, "advantage": doc.advantages[0] if doc.advantages else None,
            "length": len(doc.completion_ids), "group_id": doc.group_id}
