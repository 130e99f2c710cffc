"""Hugging Face datasets as prompt sources of ``task=prompts`` (`rlcli.rollout.prompts`).

A source is a mapping ``{path, name, split, revision, data_files, weight}`` (`DatasetSource`): ``path`` a
Hub id, a local dataset directory, a ``save_to_disk`` directory (a Dataset or a DatasetDict) or a builder
(``parquet``, ``json``, ``csv``) reading ``data_files``. `dataset_rows` turns a split's rows into prompt
records: ``columns`` renames a column to ``prompt`` and one to ``answer``, the other columns stay as
fields for the rewards. A mixture is a list of sources with weights (``task.mixture``); `draw_mixture`
picks each prompt's source with the step's ``rng`` alone, so a resumed run draws the same prompts with
nothing checkpointed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.data.errors import RecordError
from rlcli.errors import UserError

__all__ = ["COLUMN_DOCS", "COLUMN_ROLES", "SOURCE_DOCS", "DatasetSource", "dataset_rows", "draw_mixture",
           "parse_columns", "parse_dataset", "parse_mixture", "renamed_error"]

COLUMN_ROLES = ("prompt", "answer")
SOURCE_DOCS = {
    "path": "a Hub id, a local dataset directory, a save_to_disk directory, or a builder (parquet, json, csv) "
            "reading data_files; null: no dataset",
    "name": "the dataset's configuration (load_dataset's name), e.g. main for GSM8K",
    "split": "the split to read",
    "revision": "the Hub revision (a branch, tag or commit) of a Hub id",
    "data_files": "a builder's files: a path, a list, or {split: paths}",
    "weight": "in task.mixture: the share of the prompts drawn from it (any number > 0, relative to the others)",
}
SOURCE_KEYS = tuple(SOURCE_DOCS)
COLUMN_DOCS = {"prompt": "the column of the prompt: text or chat messages",
               "answer": "the column of the answer (task.answer_pattern extracts it from the text); null: none"}
# The files `Dataset.save_to_disk` (state.json) and `DatasetDict.save_to_disk` (dataset_dict.json) write.
SAVED_MARKERS = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class DatasetSource:
    """One dataset: where it is (``path``, ``name``: its config, ``revision``, ``data_files``), the split
    to train on and its weight in a mixture."""

    path: str
    name: str | None = None
    split: str = "train"
    revision: str | None = None
    data_files: Any = None
    weight: float = 1.0

    def label(self, split: str) -> str:
        """``dataset PATH[ (NAME)] split SPLIT``, the start of every message about its rows."""
        return f"dataset {self.path}{f' ({self.name})' if self.name else ''} split {split}"


def parse_dataset(value: Any, key: str, split: str = "train") -> list[DatasetSource]:
    """The source of ``value``, a mapping (``split`` when it names none): none for None or a path of null."""
    if value is None or (isinstance(value, Mapping) and value.get("path") is None):
        return []
    if isinstance(value, Mapping):
        return [_source(value, key, weighted=False, split=split)]
    raise UserError(f"{key}: must be one dataset {{path: ..., split: ...}} (a mixture of several is "
                    f"task.mixture), got {value!r}")


def parse_mixture(value: Any) -> list[DatasetSource]:
    """The sources of ``task.mixture``, a list of datasets each with a ``weight`` > 0 (none for null/[])."""
    if not value:
        return []
    if not isinstance(value, (list, tuple)):
        raise UserError(f"task.mixture: must be a list of datasets [{{path: A, weight: 2}}, ...], got {value!r}")
    return [_source(item, f"task.mixture[{i}]", weighted=True) for i, item in enumerate(value)]


def _source(value: Any, key: str, *, weighted: bool, split: str = "train") -> DatasetSource:
    if not isinstance(value, Mapping):
        raise UserError(f"{key}: must be a dataset {{path: ..., weight: ...}}, got {value!r}")
    unknown = sorted(set(value) - set(SOURCE_KEYS))
    if unknown:
        raise UserError(f"{key}.{unknown[0]}: unknown key; a dataset has {', '.join(SOURCE_KEYS)}")
    for field in ("path", "name", "split", "revision"):
        item = value.get(field)
        if item is not None and not (isinstance(item, str) and item):
            raise UserError(f"{key}.{field}: must be a non-empty string, got {item!r}")
    if not value.get("path"):
        raise UserError(f"{key}.path: missing; give a Hub id, a dataset directory or a builder (parquet, json)")
    weight = value.get("weight")
    if weighted and weight is None:
        raise UserError(f"{key}.weight: missing; each dataset of a mixture needs a weight > 0")
    weight = 1.0 if weight is None else weight
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
        raise UserError(f"{key}.weight: must be a number > 0, got {weight!r}")
    return DatasetSource(path=value["path"], name=value.get("name"), split=value.get("split") or split,
                         revision=value.get("revision"), data_files=value.get("data_files"), weight=float(weight))


def parse_columns(value: Any) -> dict[str, str | None]:
    """``task.columns``: the dataset column of each of ``prompt`` and ``answer`` (answer null: none)."""
    value = {} if value is None else value
    if not isinstance(value, Mapping):
        raise UserError(f"task.columns: must be a mapping {{prompt: COLUMN, answer: COLUMN}}, got {value!r}")
    unknown = sorted(set(value) - set(COLUMN_ROLES))
    if unknown:
        raise UserError(f"task.columns.{unknown[0]}: unknown key; task.columns maps {' and '.join(COLUMN_ROLES)}")
    columns = {role: value.get(role, role) for role in COLUMN_ROLES}
    if not isinstance(columns["prompt"], str) or not columns["prompt"]:
        raise UserError(f"task.columns.prompt: must be a column name, got {columns['prompt']!r}")
    if columns["answer"] is not None and not (isinstance(columns["answer"], str) and columns["answer"]):
        raise UserError(f"task.columns.answer: must be a column name or null (no answers), got {columns['answer']!r}")
    return columns


def dataset_rows(source: DatasetSource, split: str, columns: Mapping[str, str | None], key: str,
                 ) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for each row of ``split``: ``where`` names the dataset, split and row, the
    record holds ``prompt`` and ``answer`` (from ``columns``) and the row's other columns."""
    dataset = _load(source, split, key)
    wanted = [c for c in columns.values() if c is not None]
    missing = [c for c in wanted if c not in dataset.column_names]
    if missing:
        raise UserError(f"task.columns: {source.label(split)} has no column {missing[0]!r}; its columns are "
                        f"{', '.join(dataset.column_names)}"
                        + ("; set task.columns.answer=null for prompts without answers"
                           if missing[0] == columns["answer"] else ""))
    clashing = [c for c in dataset.column_names if c in columns and columns[c] != c]
    if clashing:
        raise UserError(f"task.columns: {source.label(split)} has a column {clashing[0]!r} that is named like "
                        f"task.columns.{clashing[0]}, which is {columns[clashing[0]] or 'null'}; map it "
                        f"(task.columns.{clashing[0]}={clashing[0]}) or rename the column")
    renamed = {column: role for role, column in columns.items() if column is not None}
    for row, values in enumerate(dataset):
        yield f"{source.label(split)} row {row}", {renamed.get(c, c): v for c, v in values.items()}


def renamed_error(err: RecordError, columns: Mapping[str, str | None]) -> RecordError:
    """``err`` naming the dataset's column (``question``) instead of the role it plays (``prompt``)."""
    role, bracket, rest = (err.field or "").partition("[")
    column = columns.get(role)
    return RecordError(err.source, column + bracket + rest, err.reason) if column else err


def _load(source: DatasetSource, split: str, key: str) -> Any:
    """The ``split`` of ``source`` as a `datasets.Dataset`; a `UserError` of one line if it cannot load."""
    import datasets

    local = Path(source.path).expanduser()
    try:
        if local.is_dir() and any((local / marker).is_file() for marker in SAVED_MARKERS):
            given = [k for k in ("name", "revision", "data_files") if getattr(source, k) is not None]
            if given:
                raise UserError(f"{key}.{given[0]}: {source.path} was written by save_to_disk, which has no "
                                f"{given[0]} to choose; leave it null")
            saved = datasets.load_from_disk(str(local))
            if isinstance(saved, datasets.DatasetDict):
                if split not in saved:
                    raise UserError(f"{key}: {source.label(split)}: no such split; it has {', '.join(saved)}")
                return saved[split]
            if split != source.split:
                raise UserError(f"{key}: {source.label(split)}: {source.path} holds one Dataset, not splits; "
                                "give the held-out prompts as task.eval_dataset")
            return saved
        return datasets.load_dataset(source.path, source.name, split=split, revision=source.revision,
                                     data_files=_plain_files(source.data_files))
    except UserError:
        raise
    except ConnectionError:  # not in the datasets cache either
        if datasets.config.HF_HUB_OFFLINE:
            reason = (f"{key}.path: {source.path} is not a local directory nor in the datasets cache, and "
                      "HF_HUB_OFFLINE is set, so it cannot come from the Hugging Face Hub; download it first or "
                      "unset HF_HUB_OFFLINE")
        else:
            reason = f"{key}: cannot load {source.label(split)}: the Hugging Face Hub cannot be reached"
        raise UserError(reason) from None
    except Exception as err:  # datasets raises many kinds (FileNotFoundError, ValueError, DatasetNotFoundError)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{key}: cannot load {source.label(split)}: {first}") from None


def _plain_files(value: Any) -> Any:
    """``data_files`` as `datasets` takes it: a path, a list, or a mapping of split to paths."""
    if isinstance(value, Mapping):
        return {str(k): _plain_files(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return value


def draw_mixture(rng: random.Random, sizes: Sequence[int], weights: Sequence[float], n: int) -> list[tuple[int, int]]:
    """``n`` picks ``(source, index)``: each pick's source by ``weights``, then within each source indices
    all different while its count allows (through it again when a draw needs more than it has)."""
    sources = rng.choices(range(len(sizes)), weights=weights, k=n) if len(sizes) > 1 else [0] * n
    drawn = {s: iter(draw_indices(rng, sizes[s], sources.count(s))) for s in sorted(set(sources))}
    return [(s, next(drawn[s])) for s in sources]


def draw_indices(rng: random.Random, size: int, n: int) -> list[int]:
    """``n`` indices below ``size`` drawn with ``rng``: all different while ``n`` allows."""
    picks: list[int] = []
    while len(picks) < n:
        picks += rng.sample(range(size), min(n - len(picks), size))
    return picks
