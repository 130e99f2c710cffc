"""Hugging Face datasets as prompts of ``task=prompts`` (`rlcli.rollout.hf_datasets`): local datasets saved with
``datasets`` (a Dataset, a DatasetDict, a parquet builder with data_files), ``task.columns``,
``task.answer_pattern``, mixtures drawn by weight, held-out splits, and one message for every problem."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections import Counter

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from factories import make_tokenizer, write_jsonl
from rlcli.errors import UserError
from rlcli.rollout.prompts import PromptsTask

GSM8K = {"prompt": "question", "answer": "answer"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def gsm8k_rows(start: int, n: int) -> dict[str, list]:
    """GSM8K-shaped columns: a question, a worked answer ending ``#### N``, and an extra column ``id``."""
    return {"question": [f"What is {i}+1?" for i in range(start, start + n)],
            "answer": [f"{i} plus 1 is {i + 1}.\n#### {i + 1}" for i in range(start, start + n)],
            "id": list(range(start, start + n))}


def save_dict(path, train: int = 6, test: int = 3):
    datasets.DatasetDict(train=datasets.Dataset.from_dict(gsm8k_rows(0, train)),
                         test=datasets.Dataset.from_dict(gsm8k_rows(100, test))).save_to_disk(str(path))
    return path


def task(tokenizer_dir, **options) -> PromptsTask:
    return PromptsTask(tokenizer=str(tokenizer_dir), **options)


def test_a_saved_dataset_dict_gives_its_train_split_and_eval_split_with_columns_and_pattern(tmp_path, tokenizer_dir):
    """Each row becomes a prompt: text from ``question`` as it is, the answer extracted by the pattern, ``id`` a
    field; eval_split reads the test split. Fails if columns are not renamed, the pattern's group is not taken or
    stripped, other columns are dropped, or the wrong split is read."""
    path = save_dict(tmp_path / "gsm8k")
    got = task(tokenizer_dir, dataset={"path": str(path)}, columns=GSM8K, answer_pattern="#### (.+)",
               eval_split="test")
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert [(p.text, p.answer, p.fields) for p in got.train] == [
        (f"What is {i}+1?", str(i + 1), {"id": i}) for i in range(6)]
    assert all(p.ids == tuple(hf.encode(p.text)) for p in got.train)
    assert [(p.text, p.answer) for p in got.eval_prompts()] == [
        (f"What is {i}+1?", str(i + 1)) for i in (100, 101, 102)]


def test_a_saved_dataset_trains_and_has_no_splits_to_hold_out(tmp_path, tokenizer_dir):
    """A ``Dataset.save_to_disk`` directory is the training rows; asking it for a test split is one clear error
    (fails if any split name silently returns the same rows)."""
    path = tmp_path / "one"
    datasets.Dataset.from_dict(gsm8k_rows(0, 4)).save_to_disk(str(path))
    got = task(tokenizer_dir, dataset={"path": str(path)}, columns=GSM8K, answer_pattern="#### (.+)")
    assert [p.answer for p in got.train] == ["1", "2", "3", "4"]
    with pytest.raises(UserError, match=f"dataset {path} split test: .*holds one Dataset, not splits"):
        task(tokenizer_dir, dataset={"path": str(path)}, columns=GSM8K, eval_split="test")


def test_a_parquet_builder_with_data_files_and_an_eval_dataset(tmp_path, tokenizer_dir):
    """``{path: parquet, data_files: {train: ..., test: ...}}`` reads the named split; ``eval_dataset`` reads its
    own split of the same files. Fails if data_files or the split is not passed to ``datasets``."""
    files = {}
    for split, start, n in (("train", 0, 5), ("test", 50, 2)):
        files[split] = str(tmp_path / f"{split}.parquet")
        pq.write_table(pa.table(gsm8k_rows(start, n)), files[split])
    source = {"path": "parquet", "data_files": files}
    got = task(tokenizer_dir, dataset=source, eval_dataset={**source, "split": "test"}, columns=GSM8K,
               answer_pattern="#### (.+)")
    assert [p.fields["id"] for p in got.train] == [0, 1, 2, 3, 4]
    assert [(p.text, p.answer) for p in got.eval_prompts()] == [("What is 50+1?", "51"), ("What is 51+1?", "52")]


def test_a_column_of_chat_messages_goes_through_the_chat_template(tmp_path, tokenizer_dir):
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1="}] for i in range(3)]
    path = tmp_path / "chat"
    datasets.Dataset.from_dict({"messages": messages, "solution": ["1", "2", "3"]}).save_to_disk(str(path))
    got = task(tokenizer_dir, dataset={"path": str(path)}, columns={"prompt": "messages", "answer": "solution"})
    expected = [tuple(hf.apply_chat_template(m, tokenize=True, add_generation_prompt=True, return_dict=False))
                for m in messages]
    assert [p.ids for p in got.train] == expected and [p.answer for p in got.train] == ["1", "2", "3"]
    assert all(p.fields == {} for p in got.train)


def test_answer_pattern_applies_to_files_too(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1+1=", "answer": "so #### 2 "}])
    assert task(tokenizer_dir, paths=[str(path)], answer_pattern="#### (.+)").train[0].answer == "2"


def test_every_bad_row_is_reported_at_once_with_its_dataset_split_row_and_column(tmp_path, tokenizer_dir):
    """Three bad rows of train and one of test, each named by dataset, split, row (from 0) and the dataset's column
    (``question``, not ``prompt``), in one error. Fails if reading stops at the first problem or names the role."""
    rows = gsm8k_rows(0, 5)
    rows["answer"][1] = "72"  # no ####
    rows["question"][3] = ""  # no tokens
    rows["answer"][4] = "#### "  # nothing after it for the group
    test = gsm8k_rows(10, 2)
    test["answer"][1] = "seventy"
    path = tmp_path / "bad"
    datasets.DatasetDict(train=datasets.Dataset.from_dict(rows), test=datasets.Dataset.from_dict(test)).save_to_disk(
        str(path))
    pattern = "#### (.+)"
    with pytest.raises(UserError) as caught:
        task(tokenizer_dir, dataset={"path": str(path)}, columns=GSM8K, answer_pattern=pattern, eval_split="test")
    lines = str(caught.value).splitlines()
    assert lines[0] == "task: 4 problems in the prompt files and datasets:"
    assert lines[1:] == [
        f"  dataset {path} split train row 1: field 'answer': {pattern!r} does not match '72'",
        f"  dataset {path} split train row 3: field 'question': has no tokens",
        f"  dataset {path} split train row 4: field 'answer': {pattern!r} does not match '#### '",
        f"  dataset {path} split test row 1: field 'answer': {pattern!r} does not match 'seventy'",
    ]


def test_a_missing_column_names_the_dataset_split_and_its_columns(tmp_path, tokenizer_dir):
    path = save_dict(tmp_path / "gsm8k")
    with pytest.raises(UserError) as caught:
        task(tokenizer_dir, dataset={"path": str(path)})  # the default columns: prompt, answer
    assert str(caught.value) == (f"task.columns: dataset {path} split train has no column 'prompt'; "
                                 "its columns are question, answer, id")
    with pytest.raises(UserError, match="has no column 'solution'.*task.columns.answer=null"):
        task(tokenizer_dir, dataset={"path": str(path)}, columns={"prompt": "question", "answer": "solution"})
    with pytest.raises(UserError, match="column 'answer' that is named like task.columns.answer, which is null"):
        task(tokenizer_dir, dataset={"path": str(path)}, columns={"prompt": "question", "answer": None})
    datasets.Dataset.from_dict({"question": ["1+1="], "id": [7]}).save_to_disk(str(tmp_path / "open"))
    no_answers = task(tokenizer_dir, dataset={"path": str(tmp_path / "open")},
                      columns={"prompt": "question", "answer": None})
    assert [(p.text, p.answer, p.fields) for p in no_answers.train] == [("1+1=", None, {"id": 7})]


def test_loading_failures_are_one_line_each(tmp_path, tokenizer_dir):
    """An unknown split, a builder whose files are missing, data_files for a save_to_disk directory: one line
    each, naming what."""
    path = save_dict(tmp_path / "gsm8k")
    cases = [
        ({"dataset": {"path": str(path), "split": "tset"}}, f"task.dataset: dataset {path} split tset: no such split"),
        ({"dataset": {"path": "json", "data_files": str(tmp_path / "missing.jsonl")}},
         "task.dataset: cannot load dataset json split train: "),
    ]
    cases.append(({"dataset": {"path": str(path), "data_files": "x.parquet"}},
                  f"task.dataset.data_files: {path} was written by save_to_disk, which has no data_files"))
    for options, start in cases:
        with pytest.raises(UserError) as caught:
            task(tokenizer_dir, columns=GSM8K, **options)
        assert str(caught.value).startswith(start) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.slow
def test_a_hub_id_offline_is_one_line_naming_it_and_hf_hub_offline(tmp_path, tokenizer_dir):
    """In a fresh process with HF_HUB_OFFLINE=1 (``datasets`` reads it at import): the message names the id and
    HF_HUB_OFFLINE, and nothing is downloaded."""
    code = ("import sys\nfrom rlcli.errors import UserError\nfrom rlcli.rollout.prompts import PromptsTask\n"
            "try:\n    PromptsTask(dataset={'path': 'openai/gsm8k', 'name': 'main'}, tokenizer=sys.argv[1])\n"
            "except UserError as err:\n    print(err)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code, str(tokenizer_dir)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.stdout.splitlines() == [
        "task.dataset.path: openai/gsm8k is not a local directory nor in the datasets cache, and HF_HUB_OFFLINE is "
        "set, so it cannot come from the Hugging Face Hub; download it first or unset HF_HUB_OFFLINE"], \
        out.stderr[-2000:]


def mixture_task(tmp_path, tokenizer_dir, weights: tuple[float, float]) -> PromptsTask:
    sources = []
    for name, start, n in (("a", 0, 5), ("b", 1000, 7)):
        datasets.Dataset.from_dict(gsm8k_rows(start, n)).save_to_disk(str(tmp_path / name))
        sources.append({"path": str(tmp_path / name)})
    return task(tokenizer_dir, mixture=[{**s, "weight": w} for s, w in zip(sources, weights)], columns=GSM8K)


def test_a_mixture_draws_each_prompt_from_a_dataset_as_often_as_its_weight_says(tmp_path, tokenizer_dir):
    """Weights 3 and 1: the count from ``a`` among N = 4000 draws is Binomial(N, 3/4), within 5 sd of N 3/4
    (a false failure has odds below 1e-6). Fails if weights are ignored (1/2) or inverted (1/4)."""
    mixed = mixture_task(tmp_path, tokenizer_dir, (3, 1))
    rng = random.Random(0)
    n, steps, p = 8, 500, 3 / 4
    from_a = sum(prompt.fields["id"] < 1000 for _ in range(steps) for prompt in mixed.sample_prompts(rng, n))
    total = n * steps
    assert abs(from_a - total * p) <= 5 * math.sqrt(total * p * (1 - p)), from_a


def test_a_mixture_draw_depends_on_the_seed_only_and_has_no_repeats_within_a_dataset(tmp_path, tokenizer_dir):
    """The same seed gives the same prompts (a resumed run draws what the first run drew); within one draw, the
    prompts from one dataset are all different while its size allows. Fails with state kept between calls or a
    draw with replacement."""
    mixed = mixture_task(tmp_path, tokenizer_dir, (1, 1))
    first = [mixed.sample_prompts(random.Random(seed), 6) for seed in range(50)]
    again = [mixed.sample_prompts(random.Random(seed), 6) for seed in range(50)]
    assert first == again
    for draw in first:
        counts = Counter(p.fields["id"] for p in draw)
        by_source = Counter(i < 1000 for i in counts.elements())
        for from_a in (True, False):
            distinct = sum(1 for i in counts if (i < 1000) == from_a)
            assert distinct == min(by_source[from_a], 5 if from_a else 7)
    assert len({tuple(p.fields["id"] for p in draw) for draw in first}) > 40


def test_a_mixture_with_eval_split_holds_out_each_datasets_test_split(tmp_path, tokenizer_dir):
    a, b = save_dict(tmp_path / "a", 4, 2), save_dict(tmp_path / "b", 3, 1)
    got = task(tokenizer_dir, mixture=[{"path": str(a), "weight": 1}, {"path": str(b), "weight": 2}],
               columns=GSM8K, eval_split="test")
    assert len(got.train) == 7 and [p.fields["id"] for p in got.eval_prompts()] == [100, 101, 100]


@pytest.mark.parametrize(("options", "message"), [
    ({"paths": ["x.jsonl"], "dataset": {"path": "d"}}, "task.paths: .*not both"),
    ({"dataset": {"path": "d"}, "mixture": [{"path": "e", "weight": 1}]}, "task.mixture: .*not both"),
    ({"mixture": [{"path": "e"}]}, r"task.mixture\[0\].weight: missing"),
    ({"mixture": [{"path": "e", "weight": 0}]}, r"task.mixture\[0\].weight: must be a number > 0"),
    ({"dataset": {"path": "d", "spilt": "x"}}, "task.dataset.spilt: unknown key"),
    ({"dataset": {"path": "d"}, "eval_split": "test", "eval_fraction": 0.1}, "task.eval_fraction: .*not both"),
    ({"eval_split": "test", "eval_paths": ["x.jsonl"]}, "task.eval_split: a split of the training datasets"),
    ({"dataset": {"path": "d"}, "columns": {"question": "q"}}, "task.columns.question: unknown key"),
    ({"dataset": {"path": "d"}, "answer_pattern": "####"}, "task.answer_pattern: '####' has no group"),
    ({"dataset": {"path": "d"}, "answer_pattern": "(#"}, "task.answer_pattern: '\\(#' is not a valid regex"),
])
def test_bad_dataset_options_are_one_message_naming_the_key(tokenizer_dir, options, message):
    with pytest.raises(UserError, match=message):
        task(tokenizer_dir, **options)


def test_training_problems_know_datasets_and_their_held_out_split():
    """A dataset is something to train on; its own training split as eval_split is not held out."""
    assert PromptsTask.training_problems([], [], {"path": "d"}) == []
    assert PromptsTask.training_problems([], [], None, [{"path": "d", "weight": 1}]) == []
    assert PromptsTask.training_problems([], [], {"path": None})[0].startswith("task.paths: give the prompt files")
    assert PromptsTask.training_problems([], [], {"path": "d", "split": "train"}, None, "train") == [
        "task.eval_split: train is the training split of dataset d split train; held-out prompts must not be "
        "trained on"]


def test_an_eval_dataset_alone_is_all_rlcli_eval_needs(tmp_path, tokenizer_dir):
    """No training data: the held-out prompts load (fails if the task demands prompts to train on)."""
    path = save_dict(tmp_path / "gsm8k")
    got = task(tokenizer_dir, eval_dataset={"path": str(path)}, columns=GSM8K,  # its split: test by default
               answer_pattern="#### (.+)")
    assert got.train == [] and [p.answer for p in got.eval_prompts()] == ["101", "102", "103"]


def test_a_bad_chat_message_is_named_by_its_column_and_index(tmp_path, tokenizer_dir):
    """Fails if the message names the role (``prompt[1].role``) rather than the dataset's column."""
    messages = [[{"role": "user", "content": "1+1="}, {"role": "robot", "content": "hi"}]]
    datasets.Dataset.from_dict({"messages": messages, "answer": ["2"]}).save_to_disk(str(tmp_path / "chat"))
    with pytest.raises(UserError) as caught:
        task(tokenizer_dir, dataset={"path": str(tmp_path / "chat")}, columns={"prompt": "messages"})
    assert str(caught.value).splitlines()[1] == (
        f"  dataset {tmp_path / 'chat'} split train row 0: field 'messages[1].role': must be one of system, user, "
        "assistant, tool, got 'robot'")
