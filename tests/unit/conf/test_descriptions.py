"""Every config key has a one-line description, held once in code, and the generated config reference
(docs/reference/config.md) and ``rlcli train --help`` show it.

How each test fails when broken: a schema field, loss option, task option or ``rollout.vllm`` key without
a description fails naming it (``TinyModelConfig.hidden_size``, ``loss=sapo: tau_neg``,
``task=reverse: alphabet``); a key of a composed config that the rows leave out or leave undescribed, or
that the page lacks, fails naming the key and the overrides; a stale page fails saying to run
``python -m tools.docgen``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import typing
from importlib.resources import files
from typing import Union

import pytest
import yaml
from hydra.utils import get_object
from omegaconf import DictConfig

from rlcli.conf import group_options, schema
from rlcli.conf.describe import HYDRA_KEYS, rows
from rlcli.modules import LOSSES
from rlcli.rollout.vllm_engine import OPTION_DOCS as VLLM_OPTION_DOCS
from tools.docgen import DOCS
from tools.docgen import config as config_page
from train_helpers import compose_train_config

# a config for every group option (and the combinations that add keys), as `rlcli train OVERRIDES --cfg job`
VARIANTS = [
    [f"{group}={option}", *({"model": ["model.path=/models/m"], "aggregation": ["aggregation.divisor=1"]}
                            .get(group, []) if option in ("hf", "constant") else [])]
    for group, options in group_options().items() for option in options
] + [[], ["logger=[wandb,tensorboard]"], ["data=stream", "task=prompts"], ["data=stream", "task=addition"]]


def _schema_classes() -> list[type]:
    """Every dataclass of the schema, from `TrainConfig` down (union members and base classes too)."""
    found: list[type] = []

    def visit(hint) -> None:
        origin = typing.get_origin(hint)
        if origin is Union or origin in (list, tuple):
            for arg in typing.get_args(hint):
                visit(arg)
        elif dataclasses.is_dataclass(hint) and hint not in found:
            found.append(hint)
            for field_hint in typing.get_type_hints(hint).values():
                visit(field_hint)

    visit(schema.TrainConfig)
    return found


def test_every_schema_field_has_a_description():
    undescribed = [f"{cls.__name__}.{f.name}" for cls in _schema_classes() for f in dataclasses.fields(cls)
                   if not f.metadata.get("built") and not str(f.metadata.get("doc", "")).strip()]
    assert len(_schema_classes()) > 20
    assert not undescribed, f"schema fields without a description (described(...)): {undescribed}"


def test_every_loss_option_has_a_description():
    built_in = {name: cls for name, cls in LOSSES.items() if cls.__module__.startswith("rlcli.")}  # not a test's
    undescribed = [f"loss={name}: {f.name}" for name, cls in built_in.items() for f in dataclasses.fields(cls)
                   if not str(f.metadata.get("doc", "")).strip()]
    assert {"grpo", "gspo", "cispo", "sapo", "gspo_token"} <= set(built_in)
    assert not undescribed, f"loss options without a description (field metadata 'doc'): {undescribed}"


def _yaml(group: str, option: str) -> dict:
    return yaml.safe_load((files("rlcli.conf") / group / f"{option}.yaml").read_text()) or {}


@pytest.mark.parametrize("option", group_options()["task"])
def test_every_task_option_has_a_description(option):
    """A built-in task's keys are the keywords of its class, each described in its ``OPTION_DOCS``."""
    node = _yaml("task", option)
    cls = get_object(node["_target_"])
    docs = getattr(cls, "OPTION_DOCS", {})
    keys = [key for key in node if key not in HYDRA_KEYS]
    undescribed = [key for key in keys if not docs.get(key, "").strip()]
    assert not undescribed, f"task={option}: options without a description in {cls.__name__}.OPTION_DOCS: " \
        f"{undescribed}"
    keywords = set(inspect.signature(cls).parameters)
    assert set(docs) == keywords, \
        f"{cls.__name__}.OPTION_DOCS describes {sorted(docs)}, its keywords are {sorted(keywords)}"


def test_every_rollout_vllm_key_has_a_description():
    keys = list(_yaml("rollout", "default")["vllm"])
    undescribed = [key for key in keys if not VLLM_OPTION_DOCS.get(key, "").strip()]
    assert keys and not undescribed, \
        f"rollout.vllm keys without a description in vllm_engine.OPTION_DOCS: {undescribed}"


def _leaves(node: DictConfig, prefix: str = "") -> list[str]:
    """The keys of the values (not mappings) of a composed config, as ``--cfg job`` prints them."""
    out = []
    for key in node.keys():
        if prefix == "" and key == "hydra":
            continue
        child = node._get_node(key)
        path = f"{prefix}{key}"
        out += _leaves(child, f"{path}.") if isinstance(child, DictConfig) else [path]
    return out


@pytest.fixture(scope="module")
def page() -> str:
    return (DOCS / "reference" / "config.md").read_text()


@pytest.mark.parametrize("overrides", VARIANTS, ids=[" ".join(v) or "default" for v in VARIANTS])
def test_every_key_of_every_group_option_is_described_on_the_page(overrides, page):
    cfg = compose_train_config(overrides)
    label = " ".join(overrides) or "the default config"
    described = {row.key: row for row in rows(cfg)}
    leaves = _leaves(cfg)
    assert leaves
    missing = [key for key in leaves if not described.get(key) or not described[key].doc.strip()]
    assert not missing, f"{label}: keys without a description: {missing}"
    lines = page.splitlines()
    absent = [key for key in leaves
              if not any(line.startswith(f"| `{key}` |") and config_page._text(described[key].doc) in line
                         for line in lines)]
    assert not absent, \
        f"{label}: keys missing from docs/reference/config.md with their description: {absent}"


def test_the_page_has_a_section_per_top_level_group(page):
    headings = {line[3:] for line in page.splitlines() if line.startswith("## ")}
    top_level = ("seed", "resume", "allow_targets", "callbacks")
    groups = [f.name for f in dataclasses.fields(schema.TrainConfig) if f.name not in top_level]
    assert {"Top level", *groups} <= headings


def test_rlcli_train_help_lists_the_keys_with_their_descriptions(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "rlcli", "train", "loss=sapo", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tau = next(f for f in dataclasses.fields(LOSSES["sapo"]) if f.name == "tau_neg")
    assert "loss.tau_neg=1.05" in proc.stdout
    assert tau.metadata["doc"] in proc.stdout
    assert "data.max_tokens=256" in proc.stdout
    assert "loss: cispo, grpo, gspo, gspo_token, sapo  (this config: sapo)" in proc.stdout
