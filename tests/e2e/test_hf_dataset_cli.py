"""``task=prompts`` on a Hugging Face dataset from the command line: a local GSM8K-shaped DatasetDict trains with
``task.dataset.path=DIR task.columns.prompt=question task.answer_pattern='#### (.+)'`` and ``rlcli eval`` evaluates
its test split; a Hub id offline is one line and exit 2; a run on a mixture resumed from a checkpoint draws the
prompts of a run that went straight through."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import datasets
import pytest

from factories import make_tiny_qwen2
from train_helpers import run_rlcli, straight_and_resumed

GSM8K = ["task=prompts", "task.columns.prompt=question", "task.answer_pattern='#### (.+)'",
         "rollout.max_new_tokens=2", "rollout.prompts_per_step=2", "rollout.group_size=2"]


def gsm8k_split(n: int, seed: int) -> datasets.Dataset:
    """``question`` "3+4=" and ``answer`` in GSM8K's format, "3 and 4 make 7.\\n#### 7"."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n)]
    return datasets.Dataset.from_dict({"question": [f"{a}+{b}=" for a, b in pairs],
                                       "answer": [f"{a} and {b} make {a + b}.\n#### {a + b}" for a, b in pairs]})


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-dataset")
    make_tiny_qwen2(root / "model")
    datasets.DatasetDict(train=gsm8k_split(12, 0), test=gsm8k_split(4, 1)).save_to_disk(str(root / "gsm8k"))
    return {"root": root, "model": root / "model", "data": root / "gsm8k"}


@pytest.mark.slow
def test_a_gsm8k_shaped_dataset_trains_and_rlcli_eval_evaluates_its_test_split(assets):
    """The answers of eval.json are the numbers after ``####`` of the test split, in its order (fails if the
    pattern is not applied, another split is read, or the CLI keys do not reach the task)."""
    root, dataset = assets["root"], f"task.dataset.path={assets['data']}"
    trained = run_rlcli(["train", "model=hf", f"model.path={assets['model']}", *GSM8K, dataset, "task.eval_split=test",
                         "trainer.max_steps=2", "logger=none", "hydra.run.dir=run"], root)
    assert trained.returncode == 0, trained.stderr[-3000:]
    with (root / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"] and all(0 <= float(r["reward"]) <= 1 for r in rows)

    evaluated = run_rlcli(["eval", str(root / "run" / "export"), *GSM8K, dataset, "task.eval_split=test",
                           "eval.samples=2", "hydra.run.dir=eval"], root)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((root / "eval" / "eval.json").read_text())
    test = datasets.load_from_disk(str(assets["data"]))["test"]
    assert [(r["prompt"], r["answer"]) for r in report["rows"]] == [
        (q, a.split("#### ")[1]) for q, a in zip(test["question"], test["answer"])]
    assert report["prompts"] == 4


@pytest.mark.slow
def test_a_hub_id_offline_is_one_line_and_exit_2(assets, tmp_path):
    result = run_rlcli(["train", "model=hf", f"model.path={assets['model']}", *GSM8K,
                        "task.dataset.path=openai/gsm8k", "task.dataset.name=main", "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    named = [line for line in result.stderr.splitlines() if "openai/gsm8k" in line]
    assert len(named) == 1 and "HF_HUB_OFFLINE" in named[0], result.stderr[-3000:]


@pytest.mark.slow
def test_a_run_on_a_mixture_resumed_from_a_checkpoint_draws_what_a_straight_run_drew(assets, tmp_path):
    """Two datasets weighted 2:1; a run resumed from its step-2 checkpoint writes the same rollouts and metrics as
    one that went straight through to step 4. Fails if the mixture's draw kept state outside the step's seed."""
    other = tmp_path / "other"
    gsm8k_split(5, 2).save_to_disk(str(other))
    mixture = f"task.mixture=[{{path: '{assets['data']}', weight: 2}}, {{path: '{other}', weight: 1}}]"
    common = ["model=hf", f"model.path={assets['model']}", *GSM8K, mixture, "rollout.save=true",
              "trainer.max_steps=4", "trainer.checkpoint_every=2", "logger=none"]
    straight_dir, run = straight_and_resumed(common, tmp_path)
    assert (run / "rollouts.jsonl").read_text() == (straight_dir / "rollouts.jsonl").read_text()
    prompts = {tuple(json.loads(line)["prompt_ids"]) for line in (run / "rollouts.jsonl").open()}
    assert len(prompts) > 2  # the steps drew different prompts
    with (run / "metrics.csv").open() as f, (straight_dir / "metrics.csv").open() as g:
        resumed, straight = list(csv.DictReader(f)), list(csv.DictReader(g))
    assert [(r["step"], r["loss"], r["reward"]) for r in resumed] == [(r["step"], r["loss"], r["reward"])
                                                                      for r in straight]
