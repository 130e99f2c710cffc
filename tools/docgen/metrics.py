"""The metrics reference page: every column of ``metrics.csv``, from the ``METRICS`` declarations of the
modules that emit them (``{name: rlcli.modules.metrics.Metric(when, description)}``)."""

from __future__ import annotations

import importlib
import re
from typing import NamedTuple

from rlcli.modules.metrics import Metric


class Section(NamedTuple):
    title: str
    intro: str
    modules: tuple[str, ...]  # the modules whose ``METRICS`` are columns of metrics.csv


# Every module that declares columns of metrics.csv, in the page's order. A metric declared "always"
# belongs to the first section, whichever module computes it.
SECTIONS = (
    Section("Every step", "Every row has the metrics marked always, whatever the config.",
            ("rlcli.training.module", "rlcli.training.guard")),
    Section("Loss metrics",
            "With `metrics=basic` (the default) or `metrics=with_entropy`, which logs every `basic` metric too; "
            "`metrics=none` logs none of them. For gspo and gspo_token the ratio, KL and clip metrics are taken "
            "over documents, with the sequence ratio `R_d = exp(ρ_d)` in place of `r_t`.",
            ("rlcli.modules.metrics",)),
    Section("KL penalty and mismatch correction",
            "The metrics of the [terms of a real RL loss](../concepts/math.md#kl-entropy-and-the-mismatch-correction),"
            " with `metrics=basic` or `with_entropy` (`is_rejected_fraction` whatever the level). `ref` is the "
            "reference's log-prob, `prox` the trainer's own at the start of the batch, `behav` the sampler's; "
            "`k3(δ) = exp(δ) − δ − 1`.",
            ("rlcli.modules.regularizers", "rlcli.training.rejection")),
    Section("On-policy rollouts",
            "With `data=generate`: each process's means over the rollouts it sampled for the step, then the mean "
            "over processes.",
            ("rlcli.rollout.onpolicy", "rlcli.training.sources.generate", "rlcli.training.reward_kl")),
    Section("On-policy distillation",
            "With `advantage.estimator=distill`, for every data kind: computed at the start of each batch over "
            "every process ([on-policy distillation](../concepts/math.md#on-policy-distillation)); `tlp` is the "
            "teacher's log-prob, `prox` the trainer's own.",
            ("rlcli.training.distill",)),
    Section("Prompt tasks",
            "With `task=prompts` or `task=reasoning_gym` (and `data=generate`): the task's statistics of the "
            "completions it scored for the step, each process's, then the mean over processes. The reward is "
            "[the weighted sum of the terms](../concepts/math.md#rewards-and-passk) of `task.rewards`; for "
            "`task=reasoning_gym`, one term `reasoning_gym`: reasoning-gym's score.",
            ("rlcli.rollout.rewards", "rlcli.rollout.reasoning_gym_task")),
    Section("Live loop",
            "With `data=stream`. The staleness, queue and reward values are over the step's documents on every "
            "process, so every process logs the same ([the live loop's bookkeeping]"
            "(../concepts/math.md#the-live-loops-bookkeeping)).",
            ("rlcli.training.sources.stream", "rlcli.callbacks.publish")),
    Section("Evaluation during training",
            "With `eval.every=N`: `k = eval.samples` completions of each eval prompt, `c` of them correct, sampled "
            "as `rollout.*` says and scored by the task; the mean over prompts, in the rows of steps N, 2N, … "
            "only. `rlcli eval MODEL_DIR` reports the same metrics without the `eval/` prefix "
            "([pass@k](../concepts/math.md#rewards-and-passk)).",
            ("rlcli.callbacks.evaluate",)),
)
ALWAYS = "always"


def declarations(module: str) -> dict[str, Metric]:
    """The ``METRICS`` that ``module`` declares."""
    return importlib.import_module(module).METRICS


def declared() -> list[tuple[str, Metric]]:
    """Every declared column of metrics.csv with its declaration (a name declared by two modules, such as
    ``reward``, appears twice)."""
    return [item for section in SECTIONS for module in section.modules for item in declarations(module).items()]


def matches(name: str, column: str) -> bool:
    """Whether ``column`` of a metrics.csv is the metric ``name`` (``reward/<name>`` matches ``reward/x``)."""
    pattern = "".join("[^/]+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]+>)", name))
    return re.fullmatch(pattern, column) is not None


def _sections() -> list[tuple[Section, list[tuple[str, Metric]]]]:
    """The page's sections with their metrics: the "always" ones of any module in the first, by the column
    order of metrics.csv; the others in declaration order."""
    from rlcli.training.module import FIRST_COLUMNS

    always = [(n, m) for section in SECTIONS for mod in section.modules for n, m in declarations(mod).items()
              if m.when == ALWAYS]
    always.sort(key=lambda item: (FIRST_COLUMNS.index(item[0]) if item[0] in FIRST_COLUMNS else len(FIRST_COLUMNS),
                                  item[0]))
    out = []
    for i, section in enumerate(SECTIONS):
        rest = [(n, m) for mod in section.modules for n, m in declarations(mod).items() if m.when != ALWAYS]
        out.append((section, always + rest if i == 0 else rest))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


INTRO = r"""# Metrics

`metrics.csv` in the run directory has one row per step (one optimizer update): a `step` column first, then
`loss`, `num_documents`, `documents_seen`, `num_tokens`, `grad_norm`, `lr`, then the others by name. The
loggers that `logger` turns on get the same row. Which columns a run has depends on its config: the
**when** column says what turns each one on. The [math page](../concepts/math.md#metrics) defines the
metrics of the loss and says why they are exact.

A document mean of a per-token value \(v\) weighs every document the same, whatever its length:

$$
\mu(v) = \frac{1}{D} \sum_d \frac{1}{\max(n_d, 1)} \sum_{t \in d} m_t v_t
$$

with \(D\) the step's documents, \(n_d\) the labelled tokens of document \(d\), \(m_t = 1\) on a labelled
(completion) token and \(T = \sum_t m_t\) the step's labelled tokens. `lp` is the policy's log-prob,
`old_lp` the ratio's denominator, `A` the advantage, `r_t = exp(lp_t − old_lp_t)` the ratio.

## How values combine over a step

A step is every micro-batch on every process. Each metric has the same value whatever the split of the
step into micro-batches and processes, exactly like the loss:

- Document means keep their numerators, which add over micro-batches and processes, and are divided by
  the step's \(D\) once.
- Sums (`num_documents`, `num_tokens`, `ratio_new_old_sum`, `ratio_new_old_squared_sum`,
  `num_segments`) add over micro-batches and processes.
- Maxima and minima (`max_advantage`, `min_advantage`, `is_weight_max`) reduce with max and min. A side
  with no labelled token is ignored, never a 0 placeholder: in a step with no labelled token these cells
  are left empty.
- A column that a step does not have is empty in its row: `eval/<metric>` between evaluations,
  `weight_publish_time` on steps that do not publish.
"""


def render() -> str:
    parts = [INTRO]
    for section, metrics in _sections():
        parts.append(f"\n## {section.title}\n\n{section.intro}\n\n| name | when | description |\n|---|---|---|\n")
        parts += [f"| `{name}` | {_cell(m.when)} | {_cell(m.description)} |\n" for name, m in metrics]
    return "".join(parts)
