"""``task=prompts``: records to prompts (chat templates, the system prompt), the held-out split, one
error for every broken record, the tokenizer of the model directory, stop strings in the sampler,
and a short ``rlcli train`` on a tiny Qwen2."""

from __future__ import annotations

import json
import random
import shutil
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig

from factories import make_arithmetic_dataset, make_tiny_qwen2, make_tokenizer, write_jsonl
from rlcli.conf import build_target
from rlcli.conf.validate import ConfigError, validate_config
from rlcli.errors import UserError
from rlcli.rollout.prompts import PromptsTask
from rlcli.rollout.sampler import HFSampler, sample_completions
from rlcli.rollout.samplers import build_sampler
from train_helpers import compose_train_config

SYSTEM = "Add the numbers."


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def task_of(tokenizer_dir, paths, **options) -> PromptsTask:
    return PromptsTask(paths=[str(p) for p in paths], tokenizer=str(tokenizer_dir), **options)


def template_ids(hf_tokenizer, messages, **options) -> tuple[int, ...]:
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    return tuple(out)


def difficulty_reward(completion, *, answer, prompt, difficulty):
    """A `_target_` reward that reads an extra field of the record."""
    return float(difficulty) + float(completion == answer)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_chat_messages_go_through_the_chat_template_with_the_system_prompt(tmp_path, tokenizer_dir, hf_tokenizer,
                                                                          suffix):
    user = [{"role": "user", "content": "3+4="}]
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    prefilled = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "The answer is"}]
    records = [{"prompt": m, "answer": "7"} for m in (user, own_system, prefilled)]
    path = tmp_path / f"chat{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        write_jsonl(path, records)
    task = task_of(tokenizer_dir, [path], system_prompt=SYSTEM, eval_fraction=0.0)
    system = {"role": "system", "content": SYSTEM}
    got = task.sample_prompts(random.Random(0), 3)
    by_text = {p.text: p for p in got}
    expected = [
        template_ids(hf_tokenizer, [system, *user], add_generation_prompt=True),
        template_ids(hf_tokenizer, own_system, add_generation_prompt=True),  # its own system message only
        template_ids(hf_tokenizer, [system, *prefilled], continue_final_message=True),  # the answer goes on
    ]
    assert sorted(p.ids for p in by_text.values()) == sorted(expected)
    assert all(hf_tokenizer.encode(text, add_special_tokens=False) == list(p.ids) for text, p in by_text.items())
    assert hf_tokenizer.decode(expected[2]).endswith("<|im_start|>assistant\nThe answer is")


def test_text_prompts_are_raw_text_unless_a_template_or_system_prompt_is_set(tmp_path, tokenizer_dir, hf_tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "3+4=", "answer": 7, "difficulty": 0.5}])
    [raw] = task_of(tokenizer_dir, [path]).sample_prompts(random.Random(0), 1)
    assert (raw.text, raw.ids) == ("3+4=", tuple(hf_tokenizer.encode("3+4=")))
    assert (raw.answer, raw.fields) == ("7", {"difficulty": 0.5})
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    [templated] = task_of(tokenizer_dir, [path], chat_template=own).sample_prompts(random.Random(0), 1)
    assert templated.text == "[user] 3+4=\n"
    [with_system] = task_of(tokenizer_dir, [path], system_prompt=SYSTEM).sample_prompts(random.Random(0), 1)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "3+4="}]
    assert with_system.ids == template_ids(hf_tokenizer, messages, add_generation_prompt=True)


def test_text_gets_the_special_tokens_of_the_tokenizer_and_a_template_its_own(tmp_path, tokenizer_dir):
    """With a tokenizer that adds a BOS to text (like Llama's), a text prompt starts with it, and
    templated text is not given a second one."""
    with_bos = tmp_path / "with_bos"
    bos = AutoTokenizer.from_pretrained(tokenizer_dir, bos_token="<|endoftext|>", add_bos_token=True)
    bos.save_pretrained(with_bos)
    hf = AutoTokenizer.from_pretrained(with_bos)
    messages = [{"role": "user", "content": "3+4="}]
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "3+4="}, {"prompt": messages}])
    task = task_of(with_bos, [path])
    text, chat = sorted(task.train, key=lambda p: len(p.ids))
    assert text.ids == (hf.bos_token_id, *hf.encode("3+4=", add_special_tokens=False))
    assert chat.ids == template_ids(hf, messages, add_generation_prompt=True) and chat.ids[0] != hf.bos_token_id


def test_rewards_score_the_decoded_completion_with_the_record_fields(tmp_path, tokenizer_dir, hf_tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "3+4=", "answer": "7", "difficulty": 2}])
    task = task_of(tokenizer_dir, [path], rewards=[{"name": "math_verify"},
                                                   {"_target_": "test_prompts_task.difficulty_reward"}])
    [prompt] = task.sample_prompts(random.Random(0), 1)
    eos, unused = hf_tokenizer.eos_token_id, len(hf_tokenizer) + 3  # a model row no token uses
    right = hf_tokenizer.encode("7") + [unused, eos] + hf_tokenizer.encode("8")  # cut at eos
    assert task.tokenizer.decode(right) == "7"
    wrong = hf_tokenizer.encode("8") + [eos]
    right_score, wrong_score = task.score_batch([prompt, prompt], [right, wrong])
    assert right_score.reward == pytest.approx(1.0 + 3.0) and right_score.correct
    assert wrong_score.reward == pytest.approx(2.0) and not wrong_score.correct
    assert wrong_score.terms == {"math_verify": 0.0, "difficulty_reward": 2.0}
    stats = task.take_reward_stats()
    assert stats["reward/math_verify"] == pytest.approx(0.5) and stats["reward/difficulty_reward"] == 2.5
    assert task.take_reward_stats() == {}


def test_default_reward_is_math_verify(tmp_path, tokenizer_dir, hf_tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "3+4=", "answer": "7"}])
    task = task_of(tokenizer_dir, [path])
    [prompt] = task.sample_prompts(random.Random(0), 1)
    assert task.score_batch([prompt], [hf_tokenizer.encode("so \\boxed{7}")])[0].reward == 1.0
    assert list(task.take_reward_stats()) == ["reward/math_verify", "reward_errors"]


def test_eval_fraction_holds_out_a_seeded_disjoint_split_in_file_order(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"{i}+0=", "answer": str(i), "id": i} for i in range(40)])
    split = lambda seed: task_of(tokenizer_dir, [path], eval_fraction=0.25, seed=seed)
    task = split(0)
    held = [p.fields["id"] for p in task.eval_prompts()]
    trained = {p.fields["id"] for p in task.train}
    assert len(held) == 10 and held == sorted(held) and held != list(range(10))  # shuffled, then in file order
    assert trained.isdisjoint(held) and trained | set(held) == set(range(40))
    assert [p.fields["id"] for p in split(0).eval_prompts()] == held
    assert [p.fields["id"] for p in split(1).eval_prompts()] != held
    assert {p.fields["id"] for p in task.sample_prompts(random.Random(5), 300)} == trained


def test_sample_prompts_draws_distinct_prompts_per_call_and_repeats_with_the_seed(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(5)])
    task = task_of(tokenizer_dir, [path])
    assert len({p.text for p in task.sample_prompts(random.Random(1), 5)}) == 5
    assert [p.text for p in task.sample_prompts(random.Random(1), 12)] == [
        p.text for p in task.sample_prompts(random.Random(1), 12)]
    assert len(task.sample_prompts(random.Random(2), 12)) == 12
    assert task.eval_prompts() == []


def test_eval_paths_are_the_held_out_split(tmp_path, tokenizer_dir):
    train_path = make_arithmetic_dataset(tmp_path / "train.jsonl", 6, seed=0)
    eval_path = make_arithmetic_dataset(tmp_path / "eval.parquet", 4, seed=1, chat=True)
    task = task_of(tokenizer_dir, [train_path], eval_paths=[str(eval_path)])
    assert len(task.train) == 6
    assert [p.answer for p in task.eval_prompts()] == [r["answer"] for r in pq.read_table(eval_path).to_pylist()]
    assert all(p.text.startswith("<|im_start|>user\n") for p in task.eval_prompts())
    assert PromptsTask.training_problems([str(train_path)], [str(tmp_path / "*.jsonl")]) == [
        f"task.eval_paths: {train_path} is in task.paths too; held-out prompts must not be trained on"]
    with pytest.raises(UserError, match="task.eval_fraction: .*not both"):
        task_of(tokenizer_dir, [train_path], eval_paths=[str(eval_path)], eval_fraction=0.5)
    with pytest.raises(UserError, match="leaves none to train on"):
        task_of(tokenizer_dir, [train_path], eval_fraction=0.95)


def test_training_on_held_out_prompts_is_a_config_error_and_evaluating_them_is_not(tmp_path, tokenizer_dir):
    data = make_arithmetic_dataset(tmp_path / "a.jsonl", 4, seed=0)
    overrides = ["task=prompts", f"task.tokenizer={tokenizer_dir}", f"task.paths=[{data}]", f"task.eval_paths=[{data}]"]
    for command in ("train", "sample", "loop"):
        extra = ["data=stream", "data.url=redis://127.0.0.1:1/0"] if command != "train" else []
        with pytest.raises(ConfigError) as caught:
            validate_config(compose_train_config([*overrides, *extra, "optimizer.lr=0"]), command=command)
        assert f"task.eval_paths: {data} is in task.paths too; held-out prompts must not be trained on" in \
            caught.value.problems, command
        assert any(p.startswith("optimizer.lr") for p in caught.value.problems)
    cfg = validate_config(compose_train_config(overrides), command="eval")
    assert [p.answer for p in build_target(cfg.task, "task").eval_prompts()] == [
        json.loads(line)["answer"] for line in data.read_text().splitlines()]


def test_training_needs_prompt_files_and_evaluation_the_held_out_ones(tmp_path, tokenizer_dir):
    data = make_arithmetic_dataset(tmp_path / "a.jsonl", 4, seed=0)
    only_eval = ["task=prompts", f"task.tokenizer={tokenizer_dir}", f"task.eval_paths=[{data}]"]
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_train_config(only_eval))
    assert any(p.startswith("task.paths: give the prompt files") for p in caught.value.problems)
    task = build_target(validate_config(compose_train_config(only_eval), command="eval").task, "task")
    assert len(task.eval_prompts()) == 4 and task.train == []
    with pytest.raises(UserError, match="task.paths: give the prompt files"):
        task.sample_prompts(random.Random(0), 2)


def test_broken_records_are_all_reported_in_one_error_by_file_and_line(tmp_path, tokenizer_dir):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("\n".join([
        json.dumps({"answer": "7"}),  # 1: no prompt
        json.dumps({"prompt": [{"role": "bot", "content": "hi"}]}),  # 2: a role no template knows
        json.dumps({"prompt": "1+1=" * 50}),  # 3: too long
        '{"prompt": "3+4=", ',  # 4: not JSON
        json.dumps({"prompt": "3+4=", "answer": "7"}),  # 5: fine
        json.dumps({"prompt": "3+4=", "answer": [7]}),  # 6: an answer that is no text
        json.dumps({"prompt": [{"role": "user", "content": 7}]}),  # 7: content that is no text
    ]) + "\n")
    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "2+2=", "answer": "4"}, {"prompt": None, "answer": "1"}]), parquet)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet")
    with pytest.raises(UserError) as caught:
        task_of(tokenizer_dir, [jsonl, parquet, garbage], max_prompt_tokens=40)
    message = str(caught.value)
    assert message.startswith("task: 8 problems in the prompt files:")
    for expected in [
        f"{jsonl}:1: field 'prompt': missing",
        f"{jsonl}:2: field 'prompt[0].role': must be one of system, user, assistant, tool, got 'bot'",
        f"{jsonl}:3: field 'prompt': is ",
        "more than task.max_prompt_tokens=40",
        f"{jsonl}:4: invalid JSON",
        f"{jsonl}:6: field 'answer'",
        f"{jsonl}:7: field 'prompt[0].content'",
        f"{parquet}:row 1: field 'prompt'",
        f"{garbage}: cannot read Parquet file",
    ]:
        assert expected in message
    assert f"{jsonl}:5" not in message and f"{parquet}:row 0" not in message


def test_a_record_with_a_completion_field_is_refused_not_scored_zero(tmp_path, tokenizer_dir):
    """TRL's layout ({prompt, completion}): the field would collide with the completion the rewards get, so
    every completion scored 0 (a TypeError each); without the check this builds and the test fails."""
    path = write_jsonl(tmp_path / "trl.jsonl", [{"prompt": "3+4=", "answer": "7"},
                                                {"prompt": "3+4=", "answer": "7", "completion": "7"}])
    with pytest.raises(UserError) as caught:
        task_of(tokenizer_dir, [path])
    assert f"{path}:2: field 'completion': is the name the rewards get the sampled completion's text under" \
        in str(caught.value)
    assert f"{path}:1" not in str(caught.value)


@pytest.mark.parametrize(
    ("paths", "match"),
    [([], "task.paths: give the prompt files"), (["missing.jsonl"], "task.paths: missing.jsonl: no such file")],
)
def test_missing_prompt_files_are_clear_errors(tmp_path, tokenizer_dir, paths, match, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=match):
        task_of(tokenizer_dir, paths)


def test_the_tokenizer_comes_from_the_model_directory(tmp_path):
    model_dir = make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "a.jsonl", 8, seed=0)
    cfg = validate_config(compose_train_config(["model=hf", f"model.path={model_dir}", "task=prompts",
                                                f"task.paths=[{data}]"]))
    assert cfg.task["tokenizer"] == str(model_dir) and cfg.task["rewards"] is None
    task = build_target(cfg.task, "task")
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert task.tokenizer.vocab_size == len(hf) and task.tokenizer.eos_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert task.tokenizer.pad_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert task.train[0].ids == tuple(hf.encode(task.train[0].text))


def test_a_missing_tokenizer_is_a_clear_error(tmp_path, tokenizer_dir):
    data = make_arithmetic_dataset(tmp_path / "a.jsonl", 4, seed=0)
    cfg = validate_config(compose_train_config(["task=prompts", f"task.paths=[{data}]"]))  # model=tiny: no path
    with pytest.raises(UserError, match="task.tokenizer: task=prompts needs a tokenizer"):
        build_target(cfg.task, "task")
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    with pytest.raises(UserError, match=f"task.tokenizer: {weights_only} holds no tokenizer"):
        task_of(weights_only, [data])


def test_chat_messages_need_a_chat_template(tmp_path, tokenizer_dir):
    bare = tmp_path / "bare"
    shutil.copytree(tokenizer_dir, bare)
    (bare / "chat_template.jinja").unlink()
    data = make_arithmetic_dataset(tmp_path / "a.jsonl", 4, seed=0, chat=True)
    with pytest.raises(UserError, match=f"task.chat_template: {data}:1 gives chat messages, but the tokenizer"):
        task_of(bare, [data])
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert all(p.text.endswith("=") for p in task_of(bare, [data], chat_template=own).train)


# ---- stop strings in the sampler ----

ALPHABET = ["<eos>", "<pad>", "a", "b", " ", "Q", "</", "ans>", "x"]  # one text per token id
EOS, PAD = 0, 1


def decode(ids) -> str:
    """Token texts joined, a leading space dropped as SentencePiece decoders do."""
    return "".join(ALPHABET[i] for i in ids).lstrip(" ")


class ScriptedModel(torch.nn.Module):
    """Emits ``scripts[row][t]`` at step ``t`` (near-certainly: one logit is 50 above the rest)."""

    def __init__(self, scripts: list[list[int]]) -> None:
        super().__init__()
        self.scripts = scripts
        self.weight = torch.nn.Parameter(torch.zeros(len(ALPHABET), 4))
        self.config = LlamaConfig(vocab_size=len(ALPHABET), hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, intermediate_size=8)
        self.calls = 0

    def get_output_embeddings(self):
        return SimpleNamespace(weight=self.weight)

    def forward(self, input_ids, **_):
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], len(ALPHABET))  # [B, T, V]
        for row, script in enumerate(self.scripts):
            logits[row, -1, script[min(self.calls, len(script) - 1)]] = 50.0
        self.calls += 1
        return SimpleNamespace(logits=logits)


def scripted(*texts: list[str]) -> ScriptedModel:
    return ScriptedModel([[ALPHABET.index(t) for t in text] for text in texts])


def sample_scripted(model, **options):
    settings = dict(max_new_tokens=6, temperature=1.0, stop_ids=(EOS,), pad_id=PAD, stop_strings=("</ans>",),
                    decode=decode)
    return sample_completions(model, [[2]] * len(model.scripts), generator=torch.Generator().manual_seed(0),
                              **(settings | options))


def test_a_stop_string_ends_a_completion_and_stays_in_it():
    model = scripted(
        ["a", "</", "ans>", "b", "b", "b"],  # the string spans two tokens
        ["a", "<eos>", "b", "b", "b", "b"],  # eos first
        ["a", "b", "a", "b", "a", "b"],  # no stop: the budget ends it
    )
    completions = sample_scripted(model)
    assert [[ALPHABET[i] for i in c.ids] for c in completions] == [
        ["a", "</", "ans>"], ["a", "<eos>"], ["a", "b", "a", "b", "a", "b"]]
    assert [c.stopped for c in completions] == [True, True, False]
    assert all(len(c.logprobs) == len(c.ids) and all(-1e-6 < lp <= 0 for lp in c.logprobs) for c in completions)


def test_a_stop_string_with_a_leading_space_is_found_where_decoding_drops_it():
    """The window holds a token before the string: decoding ``[" ", "Q"]`` alone gives ``"Q"``."""
    model = scripted(["a", "b", " ", "Q", "b", "b"], ["Q", " ", "Q", "b", "b", "b"])
    completions = sample_scripted(model, stop_strings=(" Q",))
    assert [[ALPHABET[i] for i in c.ids] for c in completions] == [["a", "b", " ", "Q"], ["Q", " ", "Q"]]


def test_the_sampler_runs_until_every_completion_stopped():
    model = scripted(["</", "ans>", "b", "b", "b", "b"], ["b", "b", "a", "</", "ans>", "b"])
    completions = sample_scripted(model)
    assert [len(c.ids) for c in completions] == [2, 5] and model.calls == 5


def test_build_sampler_takes_rollout_stop_strings_and_ids():
    tokenizer = SimpleNamespace(decode=decode, stop_ids=(ALPHABET.index("x"),), vocab_size=len(ALPHABET))
    rollout = SimpleNamespace(engine="hf", temperature=1.0, top_p=1.0, top_k=0, stop=["</ans>", ALPHABET.index("b")])
    model = scripted(["a", "</", "ans>", "b"], ["a", "b", "a", "a"], ["a", "x", "a", "a"])
    sampler = build_sampler(model, rollout, tokenizer)
    assert isinstance(sampler, HFSampler)
    completions = sampler.sample([[2]] * 3, max_new_tokens=4, stop_ids=(EOS,), pad_id=PAD,
                                 generator=torch.Generator().manual_seed(0))
    assert [[ALPHABET[i] for i in c.ids] for c in completions] == [["a", "</", "ans>"], ["a", "b"], ["a", "x"]]
    with pytest.raises(UserError, match=r"rollout.stop: ids \[9\] are outside the model's vocabulary"):
        build_sampler(model, SimpleNamespace(**{**vars(rollout), "stop": [9]}), tokenizer)


def test_stop_strings_need_a_decode_function():
    with pytest.raises(ValueError, match="decode"):
        sample_scripted(scripted(["a"]), decode=None)
