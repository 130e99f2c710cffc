"""Fuzz the config of `rlcli train` (issue 19, item 6): every input works or gets one message.

The overrides are drawn from the schema itself (`rlcli.conf.schema`, walked here, and the option
fields of the registered losses): for each key of each group option, values within its bounds, at
them and just past them, huge and tiny numbers, lists of the wrong length, other types, unknown keys
and config groups set to non-names; several at once. Each command goes the CLI's way in-process:
the check of group overrides, Hydra's compose (a composition error Hydra reports in one line is
fine), `validate_config`, then the build steps that read config values before there is a model or
data (seeds, task, the tiny model's config, optimizer and schedule, a sampler's draw, strategy and
Lightning Trainer) and one micro-batch of the fused loss with the config's loss terms. The outcome
must be a config or a `UserError`: anything else is what the CLI would print as a traceback. A few
drawn configs that validated run `rlcli train` for one step in a subprocess (slow).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import typing
import warnings
from datetime import timedelta
from typing import Any, Literal, Union

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import CompactHydraException
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rlcli.commands.app import group_override_errors
from rlcli.conf import build_target, schema
from rlcli.conf.validate import validate_config
from rlcli.errors import UserError
from rlcli.modules import LOSSES
from rlcli.modules.bounds import bounds_of
from train_helpers import compose_train_config, run_rlcli

FUZZ = settings(
    max_examples=250,
    deadline=timedelta(seconds=10),  # an example takes tens of milliseconds: this only catches a hang
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# the overrides that make each group option's keys exist and validate (an hf model is not loaded here)
NEEDS = {"data=stream": ("data.url=redis://127.0.0.1:1/0",), "model=hf": ("model.path=/nonexistent",),
         "aggregation=constant": ("aggregation.divisor=1",)}
OPTIONAL_GROUPS = {"wandb": "logger=wandb", "tensorboard": "logger=tensorboard", "publish": "data=stream",
                   "sample": "data=stream"}
CONFIG_GROUPS = ("loss", "aggregation", "metrics", "model", "data", "optimizer", "trainer", "strategy",
                 "logger", "task", "rollout", "experiment", "launcher")


@dataclasses.dataclass(frozen=True)
class Slot:
    """A config key: its type and bounds in the schema, and the group options it belongs to."""

    key: str
    hint: Any
    bounds: dict
    select: tuple[str, ...]


def _fields(cls) -> list[tuple[str, Any, dict]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls) if not f.metadata.get("built")]


def _option(cls) -> str:
    """The option value (``name`` or ``kind``) that selects the schema class ``cls`` of a union."""
    hints = typing.get_type_hints(cls)
    return next(typing.get_args(hints[key])[0] for key in ("name", "kind") if key in hints)


def schema_slots() -> list[Slot]:
    """Every key of every group option of the schema, and each registered loss's options."""
    slots = []

    def walk(cls, prefix: str, select: tuple[str, ...]) -> None:
        for name, hint, bounds in _fields(cls):
            key = f"{prefix}{name}"
            members = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is Union \
                else [hint]
            groups = [m for m in members if dataclasses.is_dataclass(m)]
            if not groups:
                slots.append(Slot(key, hint, bounds_of(bounds), select))
            for member in groups:
                chosen = (f"{key}={_option(member)}",) if len(groups) > 1 else (
                    (OPTIONAL_GROUPS[name],) if name in OPTIONAL_GROUPS else ())
                walk(member, f"{key}.", select + chosen + tuple(n for c in chosen for n in NEEDS.get(c, ())))

    walk(schema.TrainConfig, "", ())
    for name, cls in LOSSES.items():
        for field, hint, bounds in _fields(cls):
            slots.append(Slot(f"loss.{field}", hint, bounds_of(bounds), (f"loss={name}",)))
    return slots


SLOTS = schema_slots()

HUGE_INTS = [2**31, 2**32, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30]
ODD_FLOATS = [0.0, -0.0, 5e-324, 1e-45, 1e-40, 1.17e-38, 1e-30, 1e30, 3.4e38, 3.5e38, 1e39, 1e308, -1e308,
              math.inf, -math.inf, math.nan]
WRONG_TYPES = ["word", "${nope}", "", True, [1, 2], {"a": 1}, None, 1.5, 7]
TEXT = st.text(st.sampled_from("abz09_-./:"), max_size=8)


def _edges(hint, bounds: dict) -> list:
    """Each bound and the nearest number past it, and numbers past what 32- and 64-bit ints and float32 hold."""
    out = []
    for key, bound in bounds.items():
        outward = -1 if key in ("ge", "gt") else 1
        past = bound + outward if hint is int else math.nextafter(bound, outward * math.inf)
        out += [bound, past]
    return out + ([2**32, 2**63 - 1, 2**63, -(2**63) - 1] if hint is int else [5e-324, 1e39, 1e308])


def _in_bounds(hint, bounds: dict):
    low = bounds.get("ge", bounds.get("gt"))
    high = bounds.get("le", bounds.get("lt"))
    if hint is int:
        low = -(2**20) if low is None else low + ("gt" in bounds)
        high = low + 2**20 if high is None else high - ("lt" in bounds)
        return st.integers(low, max(low, high))
    return st.floats(min_value=low, max_value=high, exclude_min="gt" in bounds, exclude_max="lt" in bounds,
                     allow_nan=False, allow_infinity=False)


def valid_values(hint, bounds: dict) -> st.SearchStrategy:
    """Values of type ``hint`` within ``bounds`` (what the schema alone accepts)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return st.one_of(*(st.none() if a is type(None) else valid_values(a, bounds) for a in args))
    if origin is Literal:
        return st.sampled_from(args)
    if origin is tuple:
        return st.tuples(*(valid_values(a, bounds) for a in args)).map(list)
    if origin is list:
        return st.lists(valid_values(args[0], bounds), max_size=2)
    if hint in (int, float):
        return _in_bounds(hint, bounds)
    if hint is bool:
        return st.booleans()
    if hint is str:
        return TEXT
    if hint is schema.Target:
        return st.just({"_target_": "rlcli.rollout.tasks.ReverseTask"})
    return st.sampled_from(WRONG_TYPES)


def edge_values(hint, bounds: dict) -> list:
    """The values at and just past the edges of what a key of type ``hint`` with ``bounds`` takes."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        members = [v for a in args if a is not type(None) for v in edge_values(a, bounds)]
        return list({repr(v): v for v in members}.values())
    if origin in (list, tuple):
        size = len(args) if origin is tuple else 1
        items = edge_values(args[0], bounds)
        return [[], [0.5] * (size - 1), [0.5] * (size + 1), *([item] * size for item in items)]
    if hint in (int, float):
        return _edges(hint, bounds)
    if hint is schema.Target:
        return [1, {"every": 2}]
    return []


def hostile_values(hint, bounds: dict) -> list:
    """Edge values, huge and tiny numbers and values of other types."""
    return [*edge_values(hint, bounds), *HUGE_INTS, *ODD_FLOATS, *WRONG_TYPES]


def hydra_value(value) -> str:
    """``value`` as Hydra's override grammar writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"


def _override(slot: Slot, value) -> str:
    return f"{slot.key}={hydra_value(value)}"


@st.composite
def commands(draw, slots=SLOTS, valid=valid_values, hostile=True) -> list[str]:
    """Overrides of one command: up to three keys of ``slots`` with ``valid`` values and (``hostile``)
    one with a hostile value, perhaps an unknown key or a config group set to a non-name; and the
    group options the keys need."""
    chosen: dict[str, str] = {}  # group (or key) -> the override selecting its option
    overrides: dict[str, str] = {}  # key -> override
    drawn = draw(st.lists(st.sampled_from(slots), min_size=1, max_size=4))
    for i, slot in enumerate(drawn):
        select = {s.split("=")[0]: s for s in slot.select}
        if any(chosen.get(k, s) != s for k, s in select.items()):
            continue  # another option of a group already chosen
        chosen |= select
        bad = hostile and i == 0
        value = draw(st.sampled_from(hostile_values(slot.hint, slot.bounds)) if bad else valid(slot.hint, slot.bounds))
        overrides[slot.key] = _override(slot, value)
    extra = draw(st.sampled_from(["none", "none", "unknown", "group"])) if hostile else "none"
    if extra == "unknown":
        group = draw(st.sampled_from(["", "trainer.", "loss.", "model.", "optimizer."]))
        plus = draw(st.sampled_from(["+", ""]))  # without it Hydra refuses a key the config lacks
        overrides["unknown"] = f"{plus}{group}{draw(st.sampled_from(['bogus', 'max_epochs', 'betas2']))}=1"
    elif extra == "group":
        group = draw(st.sampled_from(CONFIG_GROUPS))
        overrides["group"] = f"{group}={hydra_value(draw(st.one_of(st.none(), st.integers(), st.booleans())))}"
    return [*(s for key, s in chosen.items() if key not in overrides), *overrides.values()]


def build_without_model(cfg) -> None:
    """The build steps of `rlcli train` that read config values before a model or data exist."""
    import lightning as L

    from rlcli.model.policy import tiny_model_config
    from rlcli.rollout.sampler import _truncate, check_sampling_options
    from rlcli.training.optim import build_optimizer
    from rlcli.training.strategy import build_strategy

    np.random.RandomState(cfg.seed)  # what seed_everything seeds: numpy, torch
    torch.Generator().manual_seed(cfg.seed)
    task = build_target(cfg.task, "task") if cfg.task is not None else None
    if cfg.model.kind == "tiny":
        tiny_model_config(cfg.model, task.tokenizer.vocab_size if task is not None else 64)
    optimizer, schedule = build_optimizer(cfg.optimizer, cfg.trainer.max_steps, torch.nn.Linear(2, 2))
    optimizer.step()
    schedule.step()
    if cfg.rollout is not None:
        r = cfg.rollout
        check_sampling_options(r.temperature, r.top_p, r.top_k)
        log_p = torch.log_softmax(torch.randn(2, 6) / r.temperature, dim=-1)  # as the sampler draws a token
        torch.multinomial(_truncate(log_p, r.top_p, r.top_k).exp(), 1)
    _one_micro_batch_loss(cfg)
    t = cfg.trainer
    strategy, _ = build_strategy(cfg.strategy, None, world_size=t.devices * t.num_nodes)
    L.Trainer(accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, precision=t.precision,
              strategy=strategy, max_steps=t.max_steps, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)


@functools.cache
def _composed(group_overrides: tuple[str, ...]):
    with initialize_config_module(config_module="rlcli.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(group_overrides))


def compose_quickly(overrides: list[str]):
    """What Hydra's compose gives for ``overrides``, in its two steps: the config of the group options
    (composed once for each choice of them: a compose takes a quarter of a second), then the other
    overrides, parsed and applied by Hydra's own functions. `test_compose_quickly_is_composing` checks it."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    groups = tuple(o.input_line for o in parsed if o.key_or_group in CONFIG_GROUPS)
    cfg = copy.deepcopy(_composed(groups))
    ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if o.key_or_group not in CONFIG_GROUPS], cfg)
    return cfg


def _one_micro_batch_loss(cfg) -> None:
    """The training module's fused head and loss of one micro-batch (float32), with the config's loss
    and its terms: the values the loss computes with only meet torch here."""
    from rlcli.modules import LossInputs, Segments, StepTotals, fused_micro_batch_loss
    from rlcli.training.loss import MicroBatchLoss

    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(8, 4, generator=generator), torch.randn(6, 4, generator=generator)  # [N, H] [V, H]
    labels = torch.randint(0, 6, (8,), generator=generator)  # [N]
    proximal, advantages = -3 * torch.rand(8, generator=generator), torch.randn(8, generator=generator)  # [N]
    mask, document_index, group_index = torch.ones(8), torch.arange(8) // 4, torch.arange(8) // 4  # [N]
    totals = StepTotals.of_tokens(mask, Segments.of(document_index), group_index, 2)
    batch_loss = MicroBatchLoss(cfg.loss, cfg.aggregation, cfg.metrics.level, cfg.kl, cfg.correction)
    spec, head = batch_loss.spec, batch_loss.head
    inputs = LossInputs(proximal_logprobs=proximal, advantages=advantages, mask=mask, document_index=document_index,
                        group_index=group_index, reference_logprobs=proximal - 1 if spec.kl_on else None,
                        sampler_logprobs=proximal + 0.5 if spec.correction_on else None)
    fused_micro_batch_loss(hidden, weight, labels, inputs, totals, spec, head)


def outcome(overrides: list[str]) -> str:
    """``"ok"``, ``"user"`` (one message, exit 2) or ``"hydra"`` (Hydra's one-line composition error);
    any other exception propagates: the CLI would print it as a traceback."""
    if group_override_errors(overrides):
        return "user"
    try:
        cfg = compose_quickly(overrides)
    except CompactHydraException:
        return "hydra"
    try:
        build_without_model(validate_config(cfg))
    except UserError as err:
        assert str(err).strip()
        return "user"
    return "ok"


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # Lightning's notes on the machine for every Trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


@settings(FUZZ, max_examples=8)
@given(commands())
def test_compose_quickly_is_composing(overrides):
    assume(not group_override_errors(overrides))
    try:
        expected = compose_train_config(overrides)
    except CompactHydraException as err:
        with pytest.raises(type(err)):
            compose_quickly(overrides)
        return
    assert _without_hydra(compose_quickly(overrides)) == _without_hydra(expected)


def _without_hydra(cfg) -> str:
    """The config as YAML (NaN equal to NaN) without Hydra's own node, which records the overrides."""
    return OmegaConf.to_yaml({key: cfg[key] for key in cfg if key != "hydra"})


def test_the_schema_walk_covers_every_group_option():
    """The fuzz reaches every config group's options (a schema class the walk missed would go unfuzzed)."""
    keys = {slot.key for slot in SLOTS}
    for key in ("seed", "optimizer.betas", "optimizer.momentum", "model.num_heads", "model.path", "data.url",
                "data.paths", "strategy.sharding_strategy", "logger.wandb.mode", "logger.tensorboard.subdir",
                "loss.eps_high", "loss.tau_pos", "rollout.top_p", "publish.every", "sample.workers",
                "trainer.devices", "aggregation.divisor", "callbacks", "task"):
        assert key in keys, key
    assert {s for slot in SLOTS for s in slot.select} >= {"model=hf", "data=stream", "optimizer=sgd",
                                                          "strategy=fsdp2", "logger=wandb", "loss=sapo"}


@pytest.mark.parametrize("slot", SLOTS, ids=[f"{s.key}[{','.join(s.select)}]" for s in SLOTS])
def test_each_key_at_its_edges_gives_a_config_or_one_message(slot):
    """Every key of the schema alone, at and just past each of its bounds (deterministic)."""
    for value in edge_values(slot.hint, slot.bounds):
        outcome([*slot.select, _override(slot, value)])


@FUZZ
@given(commands())
def test_any_overrides_give_a_config_or_one_message(overrides):
    outcome(overrides)


def test_the_fuzz_reaches_every_outcome():
    """The draws are not all refused: some validate and build, some fail in Hydra, most get a message."""
    seen = set()

    @settings(FUZZ, max_examples=60)
    @given(commands())
    def collect(overrides):
        seen.add(outcome(overrides))

    collect()
    assert seen == {"ok", "user", "hydra"}


# Commands for real runs: in-bounds values of a modest size (a model of a few thousand parameters, a few
# tokens per completion), so that one step takes seconds.
MODEST = {"model.hidden_size": st.sampled_from([8, 16]), "model.intermediate_size": st.integers(1, 16),
          "model.num_layers": st.integers(1, 2), "model.num_heads": st.sampled_from([1, 2, 4]),
          "rollout.prompts_per_step": st.integers(1, 3), "rollout.group_size": st.integers(1, 3),
          "rollout.max_new_tokens": st.integers(1, 4), "loss.temperature": st.floats(0.1, 10),
          "trainer.accumulate_microbatches": st.integers(1, 2), "trainer.minibatches": st.integers(1, 2),
          "trainer.batch_epochs": st.integers(1, 2), "data.max_tokens": st.integers(16, 64),
          "eval.samples": st.integers(1, 2), "eval.prompts": st.integers(1, 2), "optimizer.lr": st.floats(1e-6, 1e-2),
          "optimizer.warmup_steps": st.integers(0, 3),
          "model.compile": st.just(False)}  # compiling costs a run up to minutes on CPU (tests/*/test_compile_*)
RUNNABLE = ("loss.", "aggregation.", "metrics.", "model.", "optimizer.", "trainer.precision",
            "trainer.grad_clip", "kl.coef", "kl.estimator", "correction.", "advantage.", "rollout.", "eval.",
            "trainer.minibatches", "trainer.batch_epochs", "trainer.accumulate_microbatches", "seed")


def _runnable(hint, bounds):
    """In-bounds values of a modest size (within 1000 of the lower bound); None for keys a run does not
    fuzz (strings, lists)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        members = [st.none() if a is type(None) else _runnable(a, bounds) for a in args]
        return None if None in members else st.one_of(*members)
    if origin is Literal:
        return st.sampled_from(args)
    if origin is tuple:
        items = [_runnable(a, bounds) for a in args]
        return None if None in items else st.tuples(*items).map(list)
    if hint is bool:
        return st.booleans()
    if hint in (int, float):
        low = bounds.get("ge", bounds.get("gt", 0))
        high = min(bounds.get("le", bounds.get("lt", math.inf)), low + 1000)
        upper = "lt" if "lt" in bounds and high == bounds["lt"] else "le"
        lower = "gt" if "gt" in bounds else "ge"
        return _in_bounds(hint, {lower: low, upper: high})
    return None


SLOTS_TO_RUN = [s for s in SLOTS if s.key.startswith(RUNNABLE) and _runnable(s.hint, s.bounds) is not None
                and not any(x.startswith(("data=", "model=hf", "logger=")) for x in s.select)]


@st.composite
def runnable_commands(draw) -> list[str]:
    overrides = draw(commands(SLOTS_TO_RUN, _runnable, hostile=False))
    for key, modest in MODEST.items():
        if draw(st.booleans()) or any(o.startswith(f"{key}=") for o in overrides):
            overrides = [o for o in overrides if not o.startswith(f"{key}=")] + [f"{key}={draw(modest)!r}"]
    return overrides


@pytest.mark.slow
@settings(max_examples=2, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(runnable_commands())
def test_drawn_configs_that_validate_run_or_exit_2_without_traceback(tmp_path_factory, overrides):
    """A step of `rlcli train` on a drawn config that validated: exit 0, or 2 with one message."""
    assume(outcome(overrides) == "ok")
    run_dir = tmp_path_factory.mktemp("run")
    args = ["train", "trainer.max_steps=1", "trainer.accelerator=cpu", f"hydra.run.dir={run_dir}", *overrides]
    result = run_rlcli(args, cwd=run_dir, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode in (0, 2), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
