"""``task=prompts``: prompts from your own JSON Lines / Parquet files or Hugging Face datasets, scored by
verifiable rewards.

A record (a JSON line, a Parquet row) holds ``prompt`` (text, or chat messages
``[{"role": ..., "content": ...}, ...]``), ``answer`` (text or a number; optional when no reward
needs one) and any other fields, which the rewards get as keywords (`rlcli.rollout.rewards`), except
``completion``: the rewards get the sampled text under that name, so a record holding it is refused.

How a prompt becomes tokens (as in TRL's trainers, whose datasets look the same):

- chat messages go through the chat template (``chat_template``, else the tokenizer's), which
  writes its own special tokens, with the opening of the assistant's turn; when the last message
  is the assistant's, the template continues it instead. ``system_prompt`` comes first unless the
  messages start with a system message;
- text is used as it is, with the special tokens the tokenizer adds to any text (a BOS for Llama,
  none for Qwen). With ``chat_template`` or ``system_prompt`` set, text becomes one user message
  and goes through the template like messages.

A dataset's rows (`rlcli.rollout.hf_datasets`) become such records through ``columns``; ``answer_pattern``
extracts the answer from the answer text of files and datasets alike.

Every record is checked when the task is built; all the problems of all files and datasets are reported
in one `UserError`, each with its ``file:line`` (``file:row N`` for Parquet, ``dataset D split S row N``).

Training prompts are drawn without replacement within a call of `PromptsTask.sample_prompts`
(through the data again when a call needs more than there are), independently between calls; with a
mixture of datasets each prompt first picks its dataset by weight. The draw depends on the step's seeded
``rng`` only, so a resumed run draws the same prompts and the checkpoint holds no position.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlcli.data.errors import DataError, RecordError
from rlcli.data.readers import MAX_LISTED_PROBLEMS, expand_paths, read_records
from rlcli.errors import UserError
from rlcli.rollout import hf_datasets
from rlcli.rollout.rewards import DEFAULT_REWARDS, build_rewards
from rlcli.rollout.tasks import Prompt, Score

__all__ = ["ROLES", "HFTokenizer", "PromptsTask"]

ROLES = ("system", "user", "assistant", "tool")
RESERVED_FIELD = "completion"  # the rewards' first argument: a record's field of that name would collide with it
# The files a local tokenizer directory holds one of; without any, transformers would build an empty
# tokenizer from config.json alone.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
NO_PROMPT_FILES = ("task.paths: give the prompt files, JSON Lines or Parquet (task.paths=[train.jsonl]), "
                   "or a dataset (task.dataset.path=DIR)")


class HFTokenizer:
    """A Hugging Face tokenizer with the interface of a task's ``tokenizer`` (`rlcli.rollout.tasks`).

    ``eos_id`` is the tokenizer's eos, ``pad_id`` its pad token (eos if it has none), ``vocab_size``
    all its tokens (added ones too), ``stop_ids`` the other ids that end a completion: those of
    ``generation_config.json``'s ``eos_token_id`` (e.g. Llama 3's end of turn), as in ``generate``.
    """

    def __init__(self, tokenizer: Any, *, stop_ids: Sequence[int] = (), name: str = "the tokenizer") -> None:
        if tokenizer.eos_token_id is None:
            raise UserError(f"task.tokenizer: {name} has no eos token, so completions could not end")
        self.hf = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tokenizer)
        self.stop_ids = tuple(i for i in dict.fromkeys(stop_ids) if i != self.eos_id)
        self._ends = frozenset((self.eos_id, *self.stop_ids))

    @classmethod
    def load(cls, path: str, *, trust_remote_code: bool = False) -> HFTokenizer:
        """The tokenizer of a model directory (or a Hub name) and its generation config's eos ids."""
        from transformers import AutoTokenizer, GenerationConfig

        local = Path(path).expanduser()
        if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
            raise UserError(f"task.tokenizer: {local} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                            "set task.tokenizer to a directory that has one")
        source = str(local) if local.exists() else path
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, TypeError) as err:
            raise UserError(f"task.tokenizer: cannot load a tokenizer from {path}: {err}") from None
        try:
            eos = GenerationConfig.from_pretrained(source).eos_token_id
        except (OSError, ValueError):  # no generation_config.json
            eos = None
        stop_ids = [eos] if isinstance(eos, int) else list(eos or ())
        return cls(tokenizer, stop_ids=stop_ids, name=f"the tokenizer of {path}")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` before the first eos or stop id; special tokens and ids outside the
        tokenizer (rows of a larger model vocabulary) are left out."""
        kept = []
        for i in ids:
            if i in self._ends:
                break
            if 0 <= i < self.vocab_size:
                kept.append(i)
        return self.hf.decode(kept, skip_special_tokens=True)


def plain(value: Any) -> Any:
    """``value`` with OmegaConf containers turned into lists and dicts."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _patterns(value: Any, key: str) -> list[str]:
    """A file, a glob or a list of them, as a list."""
    value = plain(value)
    if value is None:
        return []
    if isinstance(value, (str, Path)):
        return [str(value)]
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, (str, Path)) for p in value):
        raise UserError(f"{key}: must be a file, a glob or a list of them, got {value!r}")
    return [str(p) for p in value]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class PromptsTask:
    """Prompts of ``paths`` (JSON Lines / Parquet files or globs) or of ``dataset`` (one Hugging Face
    dataset or a weighted mixture, `rlcli.rollout.hf_datasets`; not both), scored by ``rewards``.

    The held-out split, returned by `eval_prompts`, is the records of ``eval_paths``, of
    ``eval_dataset``, of the split ``eval_split`` of each dataset, or with none of these the fraction
    ``eval_fraction`` of the training records (of each dataset) chosen by a shuffle seeded by ``seed``
    (at least one record when the fraction is above 0). A task to evaluate only needs its held-out
    prompts; one to train on needs ``paths`` or ``dataset`` outside them (`training_problems`, a config
    rule of the training commands). ``columns`` names a dataset's prompt and answer columns;
    ``answer_pattern`` a regex whose first group is the answer. ``tokenizer`` is a model directory (by
    default the model's, ``model.path``); ``chat_template``, ``system_prompt``: see the module.
    A prompt of more than ``max_prompt_tokens`` tokens is an error. ``rewards`` lists reward terms
    (`rlcli.rollout.rewards.build_rewards`); None: `DEFAULT_REWARDS` (``math_verify`` alone). They run in
    ``reward_workers`` processes, each call at most ``reward_timeout`` seconds (`rlcli.rollout.reward_pool`).
    """

    OPTION_DOCS = {
        "paths": "training prompts: JSON Lines or Parquet files or globs (this or task.dataset to train)",
        "eval_paths": "held-out prompts for rlcli eval (all it needs) and eval.every; none of task.paths among them",
        "eval_fraction": "without another held-out split: this fraction of the training prompts (of each dataset) "
                         "is held out, chosen by a shuffle seeded by seed",
        "dataset": "training prompts from a Hugging Face dataset {path, name, split, revision, data_files}: path a "
                   "Hub id, a dataset or save_to_disk directory, or a builder (parquet, json, csv) with data_files; "
                   "path null: none",
        "mixture": "training prompts from several datasets, each prompt's drawn by weight with the step's seed: "
                   "[{path: A, weight: 2}, {path: B, split: train, weight: 1}]",
        "eval_dataset": "held-out prompts from one dataset {path, name, split, revision, data_files}",
        "eval_split": "held-out prompts: this split (e.g. test) of each training dataset",
        "columns": "the dataset columns that hold the prompt (text or chat messages) and the answer (null: none); "
                   "the other columns go to the rewards as fields",
        "answer_pattern": "a regex whose first group is the answer, searched in each record's answer "
                          "('#### (.+)' for GSM8K); null: the answer as it is",
        "seed": "seeds the shuffle that holds out eval_fraction; by default the run's seed",
        "tokenizer": "a directory with a Hugging Face tokenizer; by default model.path",
        "trust_remote_code": "let transformers run the tokenizer's own code; by default model.trust_remote_code",
        "chat_template": "a Jinja chat template; null: the tokenizer's. Set (or system_prompt), it also wraps "
                         "text prompts",
        "system_prompt": "a system message put before every prompt (unless it starts with one)",
        "max_prompt_tokens": "the longest prompt in tokens; a longer one is an error naming its file:line",
        "rewards": "the reward terms and their weights, [{name: math_verify, weight: 1.0}, {_target_: my.fn}, ...]; "
                   "null: math_verify alone",
        "reward_workers": "worker processes that run the reward functions, each call with a timeout; null: the "
                          "cores (shared by the node's training processes); 0: in the training process, no timeout",
        "reward_timeout": "seconds a reward call may take in a worker; then it scores 0, counted in reward_errors",
    }
    OPTION_KEYS = {"dataset": hf_datasets.SOURCE_DOCS, "eval_dataset": hf_datasets.SOURCE_DOCS,
                   "columns": hf_datasets.COLUMN_DOCS}

    def __init__(
        self,
        paths: Any = (),
        *,
        eval_paths: Any = (),
        eval_fraction: float = 0.0,
        seed: int = 0,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        chat_template: str | None = None,
        system_prompt: str | None = None,
        max_prompt_tokens: int = 1024,
        rewards: Any = None,
        dataset: Any = None,
        mixture: Any = None,
        eval_dataset: Any = None,
        eval_split: str | None = None,
        columns: Any = None,
        answer_pattern: str | None = None,
        reward_workers: int | None = None,
        reward_timeout: float = 10.0,
    ) -> None:
        patterns, eval_patterns = _patterns(paths, "task.paths"), _patterns(eval_paths, "task.eval_paths")
        sources = _training_sources(dataset, mixture)
        eval_sources = hf_datasets.parse_dataset(plain(eval_dataset), "task.eval_dataset", split="test")
        if patterns and sources:
            raise UserError("task.paths: give the training prompts either as files (task.paths) or as "
                            "datasets (task.dataset, or task.mixture), not both")
        if eval_split is not None and not (isinstance(eval_split, str) and eval_split):
            raise UserError(f"task.eval_split: must be a split name (e.g. test) or null, got {eval_split!r}")
        if eval_split is not None and not sources:
            raise UserError("task.eval_split: a split of the training datasets, and there are none; set "
                            "task.dataset.path (or task.mixture)")
        if not (patterns or eval_patterns or sources or eval_sources):
            raise UserError(NO_PROMPT_FILES)
        if not (_is_number(eval_fraction) and 0 <= eval_fraction < 1):
            raise UserError(f"task.eval_fraction: must be a number in [0, 1), got {eval_fraction!r}")
        held_out_keys = [k for k, v in (("task.eval_paths", eval_patterns), ("task.eval_dataset", eval_sources),
                                        ("task.eval_split", eval_split), ("task.eval_fraction", eval_fraction)) if v]
        if len(held_out_keys) > 1:
            raise UserError(f"{held_out_keys[-1]}: give the held-out prompts one way: "
                            f"{' and '.join(held_out_keys)}, not both")
        self.columns = hf_datasets.parse_columns(plain(columns))
        self.answer_pattern = _answer_pattern(answer_pattern)
        if not (isinstance(max_prompt_tokens, int) and not isinstance(max_prompt_tokens, bool)
                and max_prompt_tokens >= 1):
            raise UserError(f"task.max_prompt_tokens: must be an integer >= 1, got {max_prompt_tokens!r}")
        for key, value in (("chat_template", chat_template), ("system_prompt", system_prompt)):
            if value is not None and not (isinstance(value, str) and value):
                raise UserError(f"task.{key}: must be a non-empty string or null, got {value!r}")
        self.rewards = build_rewards(DEFAULT_REWARDS if rewards is None else plain(rewards), key="task.rewards",
                                     workers=reward_workers, timeout=reward_timeout)
        if tokenizer is None:
            raise UserError("task.tokenizer: task=prompts needs a tokenizer: give a Hugging Face model "
                            "(model=hf model.path=DIR), whose tokenizer it uses, or task.tokenizer=DIR")
        self.tokenizer = HFTokenizer.load(str(tokenizer), trust_remote_code=trust_remote_code)
        self.tokenizer_path = str(tokenizer)
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens

        files, eval_files = _files(patterns, "task.paths"), _files(eval_patterns, "task.eval_paths")
        problems: list[str] = []
        parts = [self._read(files, "task.paths", problems)] if files else []
        parts += [self._read_dataset(s, s.split, "task.dataset", problems) for s in sources]
        held_out = self._read(eval_files, "task.eval_paths", problems) if eval_files else []
        for s in eval_sources:
            held_out += self._read_dataset(s, s.split, "task.eval_dataset", problems)
        for s in sources if eval_split else ():
            held_out += self._read_dataset(s, eval_split, "task.eval_split", problems)
        if problems:
            where = "prompt files and datasets" if sources or eval_sources else "prompt files"
            lines = [f"task: {len(problems)} problems in the {where}:"]
            lines += [f"  {p}" for p in problems[:MAX_LISTED_PROBLEMS]]
            if len(problems) > MAX_LISTED_PROBLEMS:
                lines.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
            raise UserError("\n".join(lines))
        if eval_fraction:
            splits = [_hold_out(part, eval_fraction, seed) for part in parts]
            parts = [train for train, _ in splits]
            held_out = [p for _, part in splits for p in part]
        self.parts = parts
        self.weights = [s.weight for s in sources] if sources else [1.0] * len(parts)
        self.train = [p for part in parts for p in part]
        self.held_out = held_out

    @staticmethod
    def training_problems(paths: Any, eval_paths: Any, dataset: Any = None, mixture: Any = None,
                          eval_split: Any = None) -> list[str]:
        """What keeps a task of these keys from being trained on: no prompt files nor dataset, held-out
        files among them, or ``eval_split`` a dataset's training split. Files that cannot be found are
        left to the task's build."""
        try:
            patterns, eval_patterns = _patterns(paths, "task.paths"), _patterns(eval_paths, "task.eval_paths")
            files, eval_files = _files(patterns, "task.paths"), _files(eval_patterns, "task.eval_paths")
            sources = _training_sources(dataset, mixture)
        except UserError:
            return []
        if not files and not sources:
            return [NO_PROMPT_FILES]
        trained_on = [s for s in sources if s.split == eval_split]
        if trained_on:
            return [f"task.eval_split: {eval_split} is the training split of {trained_on[0].label(eval_split)}; "
                    "held-out prompts must not be trained on"]
        both = {f.resolve() for f in files} & {f.resolve() for f in eval_files}
        if both:
            return [f"task.eval_paths: {sorted(map(str, both))[0]} is in task.paths too; "
                    "held-out prompts must not be trained on"]
        return []

    def _read(self, files: list[Path], key: str, problems: list[str]) -> list[Prompt]:
        """The prompts of every record of ``files``; each bad record (or unreadable file) adds a
        line to ``problems``."""
        prompts = []
        for path in files:
            try:
                for source, record in read_records(path):
                    if isinstance(record, RecordError):
                        problems.append(str(record))
                        continue
                    try:
                        prompts.append(self._prompt(self._extract_answer(record, source), source))
                    except RecordError as err:
                        problems.append(str(err))
            except DataError as err:
                problems.append(str(err))
        if not prompts and not problems:
            problems.append(f"{key}: {', '.join(map(str, files))} hold no records")
        return prompts

    def _read_dataset(self, source: hf_datasets.DatasetSource, split: str, key: str,
                      problems: list[str]) -> list[Prompt]:
        """The prompts of the rows of ``split`` of ``source``; each bad row adds a line to ``problems``
        (naming the dataset's column, not the role it plays)."""
        prompts = []
        for where, record in hf_datasets.dataset_rows(source, split, self.columns, key):
            try:
                prompts.append(self._prompt(self._extract_answer(record, where), where))
            except RecordError as err:
                problems.append(str(hf_datasets.renamed_error(err, self.columns)))
        if not prompts and not problems:
            problems.append(f"{key}: {source.label(split)} has no rows")
        return prompts

    def _extract_answer(self, record: Mapping[str, Any], source: str) -> Mapping[str, Any]:
        """``record`` with its answer replaced by ``answer_pattern``'s first group (stripped)."""
        answer = record.get("answer")
        if self.answer_pattern is None or not (isinstance(answer, str) or _is_number(answer)):
            return record
        found = self.answer_pattern.search(str(answer))
        if found is None or found.group(1) is None:
            shown = str(answer) if len(str(answer)) <= 80 else f"{str(answer)[:40]}...{str(answer)[-37:]}"
            raise RecordError(source, "answer", f"{self.answer_pattern.pattern!r} does not match {shown!r}")
        return {**record, "answer": found.group(1).strip()}

    def _prompt(self, record: Mapping[str, Any], source: str) -> Prompt:
        """The `Prompt` of one record; a `RecordError` naming ``source`` and the field if it is bad."""
        if "prompt" not in record:
            raise RecordError(source, "prompt", "missing")
        if RESERVED_FIELD in record:
            raise RecordError(source, RESERVED_FIELD, "is the name the rewards get the sampled completion's text "
                                                      "under; a record cannot give it (rename the field)")
        value, answer = record["prompt"], record.get("answer")
        if answer is not None and not isinstance(answer, str):
            if not (_is_number(answer) and math.isfinite(answer)):
                raise RecordError(source, "answer", f"must be text or a finite number, got {answer!r}")
            answer = str(answer)
        if isinstance(value, str) and self.chat_template is None and self.system_prompt is None:
            text = value
            ids = self.tokenizer.hf.encode(text, add_special_tokens=True)
        else:
            messages = [{"role": "user", "content": value}] if isinstance(value, str) else _messages(value, source)
            text = self._apply_template(messages, source)
            ids = self.tokenizer.hf.encode(text, add_special_tokens=False)
        if not ids:
            raise RecordError(source, "prompt", "has no tokens")
        if len(ids) > self.max_prompt_tokens:
            raise RecordError(source, "prompt", f"is {len(ids)} tokens long, more than "
                                                f"task.max_prompt_tokens={self.max_prompt_tokens}")
        fields = {k: v for k, v in record.items() if k not in ("prompt", "answer")}
        return Prompt(text=text, ids=tuple(ids), answer=answer, fields=fields, source=source)

    def _apply_template(self, messages: list[dict], source: str) -> str:
        if self.chat_template is None and self.tokenizer.hf.chat_template is None:
            raise UserError(f"task.chat_template: {source} gives chat messages, but the tokenizer of "
                            f"{self.tokenizer_path} has no chat template; set task.chat_template (Jinja)")
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        continued = messages[-1]["role"] == "assistant"
        try:
            return self.tokenizer.hf.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=not continued, continue_final_message=continued,
            )
        except Exception as err:  # a Jinja error, or the template's own raise_exception
            raise RecordError(source, "prompt", f"the chat template fails on it: {err}") from None

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` training prompts drawn with ``rng``: each one's dataset by weight, then all different
        within a dataset while its count allows."""
        if not self.train:
            raise UserError(NO_PROMPT_FILES)
        picks = hf_datasets.draw_mixture(rng, [len(part) for part in self.parts], self.weights, n)
        return [self.parts[s][i] for s, i in picks]

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts, in file order (empty without a held-out split)."""
        return list(self.held_out)

    def score_batch(self, prompts: Sequence[Prompt], completion_ids: Sequence[Sequence[int]]) -> list[Score]:
        """Each completion's `Score` from the rewards, on its text (before eos, special tokens left out)."""
        return self.rewards.score_batch([self.tokenizer.decode(ids) for ids in completion_ids], prompts)

    @property
    def has_accuracy_term(self) -> bool:
        """A term of the reward alone decides correctness (``exact_match``, ``math_verify``): dynamic sampling's
        default metric is then ``accuracy`` (math.md#dynamic-sampling)."""
        return any(term.decides for term in self.rewards.terms)

    def take_reward_stats(self) -> dict[str, float]:
        """``reward/<name>`` and ``reward_errors`` since the last call (`RewardSet.take_stats`)."""
        return self.rewards.take_stats()


def check_prompt_room(task: Any, *, max_tokens: int, max_new_tokens: int) -> None:
    """A `UserError` naming the training prompts of a `PromptsTask` (other tasks draw theirs as they go) that
    leave no room for a completion of ``max_new_tokens`` (rollout.max_new_tokens) in a document of at most
    ``max_tokens`` (data.max_tokens): each would stop the run on the step that draws it."""
    room = max_tokens - max_new_tokens
    long = [p for p in task.train if len(p.ids) > room] if isinstance(task, PromptsTask) else []
    if not long:
        return
    lines = [f"data.max_tokens: training prompts longer than the {room} tokens that data.max_tokens={max_tokens} "
             f"leaves beside rollout.max_new_tokens={max_new_tokens} (raise data.max_tokens, which a resumed run "
             "may, or shorten or drop these prompts):"]
    lines += [f"  {p.source}: {len(p.ids)} tokens" for p in long[:MAX_LISTED_PROBLEMS]]
    if len(long) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(long) - MAX_LISTED_PROBLEMS} more")
    raise UserError("\n".join(lines))


def _training_sources(dataset: Any, mixture: Any) -> list[hf_datasets.DatasetSource]:
    """The datasets to train on: ``dataset``'s one or ``mixture``'s, not both."""
    one = hf_datasets.parse_dataset(plain(dataset), "task.dataset")
    several = hf_datasets.parse_mixture(plain(mixture))
    if one and several:
        raise UserError("task.mixture: give one dataset (task.dataset) or a mixture (task.mixture), not both")
    return one or several


def _answer_pattern(value: Any) -> re.Pattern | None:
    """``task.answer_pattern`` compiled; it needs a group, the answer."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise UserError(f"task.answer_pattern: must be a regex with a group, e.g. '#### (.+)', got {value!r}")
    try:
        pattern = re.compile(value)
    except re.error as err:
        raise UserError(f"task.answer_pattern: {value!r} is not a valid regex: {err}") from None
    if pattern.groups < 1:
        raise UserError(f"task.answer_pattern: {value!r} has no group; the first group is the answer, "
                        "e.g. '#### (.+)'")
    return pattern


def _hold_out(prompts: list[Prompt], fraction: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)``: the fraction of ``prompts`` chosen by a shuffle seeded by ``seed`` held out."""
    count = max(1, round(fraction * len(prompts)))
    if count >= len(prompts):
        raise UserError(f"task.eval_fraction: holding out {count} of the {len(prompts)} training prompts "
                        "leaves none to train on")
    order = list(range(len(prompts)))
    random.Random(f"rlcli-eval-split/{seed}").shuffle(order)
    chosen = set(order[:count])
    return ([p for i, p in enumerate(prompts) if i not in chosen], [p for i, p in enumerate(prompts) if i in chosen])


def _files(patterns: list[str], key: str) -> list[Path]:
    """The files ``patterns`` name (`expand_paths`); none for no patterns."""
    try:
        return expand_paths(patterns) if patterns else []
    except DataError as err:
        raise UserError(f"{key}: {err}") from None


def _messages(value: Any, source: str) -> list[dict]:
    """``value`` checked as a non-empty list of chat messages, each with a role and text content
    (other keys are kept for the template)."""
    if not isinstance(value, list) or not value:
        kind = "an empty list" if isinstance(value, list) else repr(value)
        raise RecordError(source, "prompt", f"must be text or a non-empty list of chat messages, got {kind}")
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise RecordError(source, f"prompt[{i}]", f"must be a message {{role, content}}, got {message!r}")
        if message.get("role") not in ROLES:
            raise RecordError(source, f"prompt[{i}].role", f"must be one of {', '.join(ROLES)}, "
                                                          f"got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise RecordError(source, f"prompt[{i}].content", f"must be text, got {message.get('content')!r}")
    return [dict(m) for m in value]
