"""The config reference page: every group, its options and every key with its type, default, bounds
or choices and description, from the config directory, the schema and the code that describes the
rest (`rlcli.conf.describe`, which ``rlcli train --help`` prints too)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Union

from rlcli.conf.describe import NO_KEYS_OF_THEIR_OWN, Row, compose, group_options, option_doc, rows
from rlcli.conf.schema import TrainConfig
from rlcli.conf.typecheck import Target

INTRO = """\
# Config reference

Every `rlcli train` run is configured by one Hydra config, composed from the YAML files in
`rlcli/conf/`. `rlcli sample`, `rlcli loop` and `rlcli eval` compose the same config. This page lists
every key with its type, default, bounds and meaning.

- **Set a key** with `KEY=VALUE` on the command line: `rlcli train loss.temperature=0.7 trainer.max_steps=200`.
- **Pick a group option** with `GROUP=OPTION`: `loss=gspo` loads `rlcli/conf/loss/gspo.yaml` into the
  `loss` key. A group is a folder of options; a key is one value inside the config. Pick a group first,
  then set its keys: `aggregation=constant aggregation.divisor=1`. `~GROUP` leaves a group out.
- **Add a key** that no file has with `+KEY=VALUE`. The schema refuses unknown keys, except where a
  mapping is passed through: `+rollout.vllm.KEY=VALUE`, and the options of your own task
  (`+task.level=3`).
- **See the result**: `rlcli train [OVERRIDES] --cfg job` prints the composed config, and
  `rlcli train [OVERRIDES] --help` prints every key of it with its description. `--hydra-help` is
  Hydra's own help.
- **Defaults** live in the YAML files only: `rlcli/conf/config.yaml` (top-level keys, `loss`, `kl`,
  `correction`, `advantage`, `eval`) and one file per group option. `${...}` is an interpolation:
  the default follows another key. `???` marks a key you must set. Your own files go in
  `rlcli_local/` (e.g. `rlcli_local/loss/my_loss.yaml`), which is on Hydra's search path.

The config is checked against its schema (`rlcli/conf/schema.py`) before anything runs. Every problem
is reported at once, with exit code 2.
"""


def _text(text: str) -> str:
    """Text in a Markdown table: its ``\\``, ``_``, ``*``, ``<``, ``>`` and ``|`` shown as they are, its
    `code spans` kept."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        for char in "\\_*":
            parts[i] = parts[i].replace(char, "\\" + char)
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def _code(text: str) -> str:
    return ("`" + text.replace("|", "\\|") + "`") if text else ""


def _table(table_rows: list[Row]) -> list[str]:
    if not table_rows:
        return ["No keys.", ""]
    lines = ["| key | type | default | bounds or choices | description |", "|---|---|---|---|---|"]
    for row in table_rows:
        lines.append(f"| {_code(row.key)} | {_text(row.type)} | {_code(row.default)} | {_text(row.limits)} "
                     f"| {_text(row.doc)} |")
    return lines + [""]


def _under(table_rows: list[Row], key: str) -> list[Row]:
    return [row for row in table_rows if row.key == key or row.key.startswith(f"{key}.")]


def _groups_table(groups: dict[str, list[str]], defaults: dict) -> list[str]:
    lines = ["## Groups and their options", "",
             "The default option of each group is in bold. `experiment` and `launcher` have none.", "",
             "| group | option | what |", "|---|---|---|"]
    for group, options in groups.items():
        for option in options:
            name = f"**`{option}`**" if defaults.get(group) == option else f"`{option}`"
            what = option_doc(group, option)
            link = " See [Slurm](../how-to/slurm.md) for its `hydra.launcher` fields." if group == "launcher" else ""
            lines.append(f"| `{group}` | {name} | {_text(what)}{link} |")
    return lines + [""]


def _group_section(key: str, options: list[str], per_option: dict[str, list[Row]], default: str | None) -> list[str]:
    """A group's keys: those every option shares once, then each option's own."""
    lines = []
    shared = [row for row in per_option[options[0]] if len(options) > 1 and all(row in per_option[o] for o in options)]
    if shared:
        lines += [f"Every `{key}` option has these keys:", ""] + _table(shared)
    for option in options:
        mark = " (default)" if option == default else ""
        lines += [f"### `{key}={option}`{mark}", ""]
        doc = option_doc(key, option)
        if doc:
            lines += [_text(doc), ""]
        lines += _table([row for row in per_option[option] if row not in shared])
    return lines


def render() -> str:
    groups = group_options()
    base = compose(with_hydra=True)
    defaults = dict(base.hydra.runtime.choices)
    variants = {(group, option): compose([f"{group}={option}"]) for group, options in groups.items()
                if group not in NO_KEYS_OF_THEIR_OWN for option in options}
    base_rows = rows(base)
    variant_rows = {choice: rows(cfg) for choice, cfg in variants.items()}

    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name: f.metadata["doc"] for f in dataclasses.fields(TrainConfig)}
    top = [name for name in fields if not _is_group(hints[name])]
    lines = [INTRO, *_groups_table(groups, defaults), "## Top level", "",
             "The keys of `rlcli/conf/config.yaml` outside any group.", ""]
    lines += _table([row for row in base_rows if row.key in top])
    for name, doc in fields.items():
        if name in top:
            continue
        lines += [f"## {name}", "", _text(doc[0].upper() + doc[1:]) + ".", ""]
        if name in groups:
            options = groups[name]
            per_option = {option: _under(variant_rows[name, option], name) for option in options}
            lines += _group_section(name, options, per_option, defaults.get(name))
        elif _under(base_rows, name):
            lines += _table(_under(base_rows, name))
        else:
            present = {choice: _under(table, name) for choice, table in variant_rows.items() if _under(table, name)}
            lines += ["Present with " + ", ".join(f"`{g}={o}`" for g, o in present) + ".", ""]
            lines += _table(next(iter(present.values())))
    return "\n".join(lines).rstrip() + "\n"


def _is_group(hint) -> bool:
    """A key that holds keys (a dataclass, a union of them, a `_target_` node), not a value."""
    members = [m for m in typing.get_args(hint) if m is not type(None)] if typing.get_origin(hint) is Union else [hint]
    return any(dataclasses.is_dataclass(m) or m is Target for m in members)
