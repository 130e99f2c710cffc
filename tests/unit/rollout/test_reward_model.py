"""The ``model`` reward term: a tiny local sequence-classification model's logits, compared with the model's own
forward on each sequence alone in float64 (tokenized here, independently of rlcli's code), batch-size and padding
invariance, left truncation, ``label``, a hand-built model with a known score, and bad paths and options."""

from __future__ import annotations

import shutil

import pytest
import torch
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from factories import make_suffix_reward_model, make_tiny_qwen2, make_tiny_reward_model
from rlcli.errors import UserError
from rlcli.rollout.reward_model import default_device
from rlcli.rollout.rewards import build_rewards
from rlcli.rollout.tasks import Prompt

PROMPTS = ["3+4=", "<|im_start|>user\nAdd the numbers. 12+5=<|im_end|>\n<|im_start|>assistant\n", "Q", "1+1="]
COMPLETIONS = ["7", "The answer is 17, since 12+5=17.", "", "2 <think> </think>"]
ON_CPU = {"device": "cpu"}  # float32: the default device and dtype have a test of their own


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module", params=["qwen2", "bert"])
def any_reward_model(request, tmp_path_factory):
    """A decoder, and an encoder whose score padding would change without the attention mask."""
    return make_tiny_reward_model(tmp_path_factory.mktemp(request.param), architecture=request.param)


def prompts(texts=PROMPTS) -> list[Prompt]:
    return [Prompt(text=t, ids=(1,), answer=None) for t in texts]


def values(directory, completions=COMPLETIONS, texts=PROMPTS, **options) -> list[float]:
    """The ``model`` term's values on ``completions`` of the prompts ``texts``, through `build_rewards`, in float32
    on the CPU also where a GPU is (there the default is bfloat16, too coarse for these comparisons)."""
    rewards = build_rewards([{"name": "model", "path": str(directory), **ON_CPU, **options}])
    return [score.terms["model"] for score in rewards.score_batch(completions, prompts(texts))]


def reference(directory, texts, label=0, keep=None) -> list[float]:
    """The model's logit ``label`` on each text alone (its last ``keep`` tokens), in float64."""
    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"][-keep if keep else 0:]
        with torch.no_grad():
            out.append(model(input_ids=torch.tensor([ids])).logits[0, label].item())
    return out


def test_the_value_is_the_models_logit_on_prompt_plus_completion(any_reward_model):
    """Fails if the prompt is left out, the completion is paired with another prompt, a pad token is read, or the
    batch's padding leaks into a shorter sequence's score."""
    expected = reference(any_reward_model, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert values(any_reward_model, batch_size=4) == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == len(expected)  # distinct scores: a mix-up of rows would show


def test_batch_size_does_not_change_the_values(any_reward_model):
    """A sequence scored alone (batch_size 1, no padding) equals it scored in a padded batch (its width the
    longest's), to float32 rounding."""
    alone = values(any_reward_model, batch_size=1)
    for batch_size in (2, 3, 8):
        assert values(any_reward_model, batch_size=batch_size) == pytest.approx(alone, abs=1e-6)


def test_suffix_and_left_truncation(reward_model):
    texts = [p + c + "<|im_end|>" for p, c in zip(PROMPTS, COMPLETIONS)]
    assert values(reward_model, suffix="<|im_end|>", batch_size=3) == pytest.approx(reference(reward_model, texts),
                                                                                    abs=1e-5)
    kept = reference(reward_model, [p + c for p, c in zip(PROMPTS, COMPLETIONS)], keep=5)
    assert values(reward_model, max_length=5, batch_size=4) == pytest.approx(kept, abs=1e-5)


def test_label_picks_one_logit_of_several(tmp_path):
    directory = make_tiny_reward_model(tmp_path / "rm3", num_labels=3)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert values(directory, label=2) == pytest.approx(reference(directory, texts, label=2), abs=1e-5)
    with pytest.raises(UserError, match=r"^task\.rewards\[0\]\.label: the model has 3 labels"):
        values(directory)
    with pytest.raises(UserError, match=r"^task\.rewards\[0\]\.label: must be an integer in 0\.\.2"):
        values(directory, label=3)


def test_a_hand_built_model_scores_by_the_texts_last_character(tmp_path):
    """`make_suffix_reward_model`: +1 when prompt + completion ends with 7, else -1 (hand-derived)."""
    directory = make_suffix_reward_model(tmp_path / "rm7", "7")
    completions = ["7", "17", "7 ", "", "77x"]
    texts = ["1+6=", "2+5=", "3+4=", "1+6=7", "Q"]
    assert values(directory, completions, texts) == pytest.approx([1, 1, -1, 1, -1], abs=1e-6)


def test_the_term_takes_the_batch_in_the_training_process_and_decides_no_correctness(reward_model):
    """Its best value is unbounded: alone it judges no completion correct (accuracy comes from a correctness
    term); the statistics are the mean of its raw values."""
    rewards = build_rewards([{"name": "model", "path": str(reward_model), "weight": 0.5}])
    (term,) = rewards.terms
    assert term.batched and term.in_process
    scores = rewards.score_batch(COMPLETIONS, prompts())
    assert not any(s.correct for s in scores)
    assert [s.reward for s in scores] == pytest.approx([0.5 * s.terms["model"] for s in scores])
    assert rewards.take_stats() == {"reward/model": pytest.approx(sum(s.terms["model"] for s in scores) / 4),
                                    "reward_errors": 0.0}


def test_the_default_device_and_dtype(reward_model):
    (term,) = build_rewards([{"name": "model", "path": str(reward_model)}]).terms
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert term.fn.device == default_device() == expected
    assert next(term.fn.model.parameters()).dtype == (torch.bfloat16 if expected.type == "cuda" else torch.float32)
    assert not term.fn.model.training
    (term,) = build_rewards([{"name": "model", "path": str(reward_model), "dtype": "float16", "device": "cpu"}]).terms
    assert next(term.fn.model.parameters()).dtype == torch.float16


@pytest.mark.parametrize(("options", "message"), [
    ({}, r"^task\.rewards\[0\]: model needs the option 'path'"),
    ({"path": "/nonexistent/rm"}, r"^task\.rewards\[0\]\.path: /nonexistent/rm is not a Hugging Face model directory"),
    ({"path": 3}, r"^task\.rewards\[0\]\.path: must be a directory of a Hugging Face model, got 3"),
    ({"path": "RM", "batch_size": 0}, r"^task\.rewards\[0\]\.batch_size: must be an integer >= 1"),
    ({"path": "RM", "max_length": 0}, r"^task\.rewards\[0\]\.max_length: must be an integer >= 1 or null"),
    ({"path": "RM", "dtype": "float64"}, r"^task\.rewards\[0\]\.dtype: must be one of float32, bfloat16, float16"),
    ({"path": "RM", "device": "nodevice"}, r"^task\.rewards\[0\]\.device: not a torch device"),
    ({"path": "RM", "suffix": 1}, r"^task\.rewards\[0\]\.suffix: must be text"),
    ({"path": "RM", "temperature": 1}, r"^task\.rewards\[0\]\.temperature: model takes no option 'temperature'"),
])
def test_bad_options_are_one_message_naming_the_key(reward_model, options, message):
    options = {key: str(reward_model) if value == "RM" else value for key, value in options.items()}
    with pytest.raises(UserError, match=message):
        build_rewards([{"name": "model", **options}])


def test_a_causal_lm_is_no_reward_model(tmp_path):
    """Hugging Face would load it with a head drawn at random, and the reward would be noise."""
    directory = make_tiny_qwen2(tmp_path / "policy")
    with pytest.raises(UserError, match=r"^task\.rewards\[0\]\.path: .* lacks the weights score\.weight"):
        build_rewards([{"name": "model", "path": str(directory)}])


def test_broken_files_are_one_message_naming_the_key(tmp_path, reward_model):
    """A weights file that is not safetensors raises SafetensorError, which is neither an OSError nor a ValueError."""
    for name, text in (("model.safetensors", "garbage"), ("config.json", '{"model_type": "qwen2", ')):
        directory = tmp_path / name
        shutil.copytree(reward_model, directory)
        (directory / name).write_text(text)
        with pytest.raises(UserError, match=rf"^task\.rewards\[0\]\.path: cannot load .*{directory}: \w+"):
            build_rewards([{"name": "model", "path": str(directory)}])


def test_a_directory_without_a_tokenizer(tmp_path, reward_model):
    directory = tmp_path / "no-tokenizer"
    AutoModelForSequenceClassification.from_pretrained(reward_model).save_pretrained(directory)
    with pytest.raises(UserError, match=r"^task\.rewards\[0\]\.path: .* holds no tokenizer"):
        build_rewards([{"name": "model", "path": str(directory)}])


def test_beside_pooled_terms_the_model_stays_in_the_training_process(reward_model):
    """With a worker pool, only the other terms go to it (a worker would load its own copy of the model); the
    columns come back in the terms' order."""
    rewards = build_rewards([{"name": "model", "path": str(reward_model), **ON_CPU},
                             {"name": "regex", "pattern": "7"}], workers=1)
    try:
        assert [spec["name"] for spec in rewards.pool.specs] == ["regex"]
        scores = rewards.score_batch(COMPLETIONS, prompts())
    finally:
        rewards.pool.close()
    expected = reference(reward_model, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert [s.terms["model"] for s in scores] == pytest.approx(expected, abs=1e-5)
    assert [s.terms["regex"] for s in scores] == [1.0, 1.0, 0.0, 0.0]


def _with_tokenizer(source, directory, edit):
    """A copy of the model directory ``source`` whose tokenizer ``edit`` changed."""
    shutil.copytree(source, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    edit(tokenizer)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_bos_the_prompt_already_starts_with_is_not_doubled(tmp_path, reward_model):
    """A tokenizer that adds a BOS (as Llama's does) to a prompt whose chat template wrote one: a single BOS."""
    def add_bos(tokenizer):
        bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
        tokenizer._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                                                 special_tokens=[("<|im_start|>", bos)])
        tokenizer.bos_token = "<|im_start|>"

    directory = _with_tokenizer(reward_model, tmp_path / "bos", add_bos)
    (term,) = build_rewards([{"name": "model", "path": str(directory)}]).terms
    plain = AutoTokenizer.from_pretrained(directory)
    bos = plain.bos_token_id
    ids = term.fn.token_ids(PROMPTS, COMPLETIONS)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    expected = [plain(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert ids == [e if e[0] == bos else [bos, *e] for e in expected]
    assert [i[:2].count(bos) for i in ids] == [1, 1, 1, 1]


def test_a_model_without_a_pad_id_takes_its_tokenizers_or_scores_one_at_a_time(tmp_path, reward_model):
    """Without the tokenizer's pad id a batch of several could not tell padding from tokens: batch_size 1 only."""
    no_config_pad = tmp_path / "no-config-pad"
    model = AutoModelForSequenceClassification.from_pretrained(reward_model)
    model.config.pad_token_id = None
    model.save_pretrained(no_config_pad)
    AutoTokenizer.from_pretrained(reward_model).save_pretrained(no_config_pad)
    expected = reference(reward_model, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert values(no_config_pad, batch_size=4) == pytest.approx(expected, abs=1e-5)

    def drop_pad(tokenizer):
        tokenizer.pad_token = None

    no_pad = _with_tokenizer(no_config_pad, tmp_path / "no-pad", drop_pad)
    with pytest.raises(UserError, match=r"^task\.rewards\[0\]\.path: the model has no pad token .* batch_size: 1"):
        values(no_pad, batch_size=2)
    assert values(no_pad, batch_size=1) == pytest.approx(expected, abs=1e-5)
