"""The toy rollout file shipped with rlcli (`rlcli/examples/toy_rollouts.jsonl`).

A uniform sampler over a 64-token vocabulary wrote random completions; the reward of a completion
is the fraction of its tokens with an even id. Training on it should raise the probability of
even tokens. Regenerate with ``python -m rlcli.data.toy PATH``.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

VOCAB_SIZE = 64


def toy_records(prompts: int = 64, group_size: int = 8, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    uniform_logprob = round(-math.log(VOCAB_SIZE), 6)
    records = []
    for prompt in range(prompts):
        prompt_ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(4, 8))]
        for _ in range(group_size):
            completion = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(4, 16))]
            records.append({
                "prompt_ids": prompt_ids,
                "completion_ids": completion,
                "old_logprobs": [uniform_logprob] * len(completion),
                "reward": sum(t % 2 == 0 for t in completion) / len(completion),
                "group_id": f"prompt-{prompt}",
                "temperature": 1.0,
            })
    return records


def write_toy_rollouts(path: Path) -> None:
    with Path(path).open("w") as f:
        for record in toy_records():
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    write_toy_rollouts(Path(sys.argv[1]))
