"""`rlcli eval MODEL_DIR`: evaluate a Hugging Face model directory on a task, a Hydra app over the same
config as `rlcli train`.

``rlcli eval MODEL_DIR [OVERRIDES]`` is ``model=hf model.path=MODEL_DIR`` plus the overrides. It reads
``model.*`` (loaded with `rlcli.model.policy.build_policy`, on a GPU when there is one and
``trainer.accelerator`` allows it), ``task``, ``rollout.*`` (the engine and sampling options of
`rlcli.rollout.samplers.build_sampler`, and ``prompts_per_step x group_size`` sequences per sampler
call), ``eval.samples``, ``eval.prompts`` and ``seed``, evaluates with `rlcli.rollout.evaluate.evaluate`,
prints a table and writes ``eval.json`` (the settings, the metrics and one row per prompt) into its run
directory (``hydra.run.dir``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlcli.commands.app import hydra_app
from rlcli.errors import UserError

log = logging.getLogger("rlcli")
USAGE = "rlcli eval MODEL_DIR [HYDRA OVERRIDES]"


def model_overrides(args: list[str]) -> list[str]:
    """``args`` (``MODEL_DIR`` first) as Hydra overrides: the directory becomes ``model=hf model.path=...``.
    Options (``--help``, ``--cfg job``) pass through; no directory, or one that does not exist, is a `UserError`."""
    if args and args[0].startswith("-"):
        return list(args)
    if not args or ("=" in args[0] and not Path(args[0]).expanduser().exists()):
        raise UserError(f"give the model directory first: {USAGE}")
    if not Path(args[0]).expanduser().is_dir():  # else the tokenizer's loader takes it for a Hub repo id
        raise UserError(f"{args[0]}: no such model directory (a local Hugging Face model directory; "
                        f"Hub names are not fetched): {USAGE}")
    path = str(Path(args[0]).expanduser().resolve()).replace("'", "\\'")
    return ["model=hf", f"model.path='{path}'", *args[1:]]


def _device(accelerator: str):
    import torch

    return torch.device("cuda" if accelerator != "cpu" and torch.cuda.is_available() else "cpu")


def _table(result, title: str):
    from rich.table import Table
    from rich.text import Text

    m = result.metrics
    table = Table(title=Text(title))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in (("mean reward", m["reward"]), ("pass@1", m["pass@1"]),
                        (f"pass@{result.samples}", m["pass@k"]), ("mean length (tokens)", m["length"]),
                        ("stopped fraction", m["stopped_fraction"])):
        table.add_row(name, f"{value:.4f}")
    for name, value in result.reward_stats.items():  # the task's own, e.g. reward/<name> per reward term
        table.add_row(name, f"{value:.4f}")
    table.add_row("prompts", str(len(result.rows)))
    return table


def evaluate_model(cfg: DictConfig, run_dir: Path) -> Path:
    """Evaluate the model ``cfg`` names on its task; returns the path of the ``eval.json`` written."""
    from rich.console import Console
    from transformers.utils import logging as transformers_logging

    from rlcli.conf import build_target
    from rlcli.conf.validate import load_config
    from rlcli.model.policy import build_policy
    from rlcli.rollout.evaluate import eval_prompts, evaluate
    from rlcli.rollout.samplers import build_sampler

    resolved, typed = load_config(cfg, command="eval")  # a task and its rollout options
    task = build_target(typed.task, "task")
    transformers_logging.disable_progress_bar()
    model = build_policy(typed.model).to(_device(typed.trainer.accelerator))
    e, r = typed.eval, typed.rollout
    prompts = eval_prompts(task, e.prompts)
    sampler = build_sampler(model, r, task.tokenizer)
    log.info("evaluating %s: %d prompts x %d samples", typed.model.path, len(prompts), e.samples)
    result = evaluate(task, sampler, prompts, samples=e.samples, max_new_tokens=r.max_new_tokens, seed=typed.seed,
                      batch_size=r.prompts_per_step * r.group_size)

    config = {"seed": typed.seed} | {key: OmegaConf.to_container(resolved[key]) for key in
                                     ("model", "task", "rollout", "eval")}
    report = {"config": config, "prompts": len(result.rows), "samples": e.samples, "metrics": result.metrics,
              "reward_stats": result.reward_stats, "rows": result.rows}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "eval.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    Console().print(_table(result, f"rlcli eval: {type(task).__name__}"))
    print(f"eval.json: {path}")
    return path


@hydra_app("eval")
def app(cfg: DictConfig, run_dir: Path) -> None:
    evaluate_model(cfg, run_dir)
