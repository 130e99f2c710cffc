"""The loss bundles from the flat keywords the tests share with the float64 references.

A test names a case as ``loss=..., aggregation=..., divisor=..., eps_high=...`` (the references'
keywords); `loss_spec` turns that into a `LossSpec` and `step_inputs` a `make_step` dict into
`LossInputs`, so each call reads ``policy_loss(lp, step_inputs(step), loss_spec(**kw))``.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from rlcli.modules import LossInputs, LossSpec, make_loss

SPEC_FIELDS = {f.name for f in fields(LossSpec)}


def loss_spec(**keywords) -> LossSpec:
    """The `LossSpec` of ``keywords``: its own fields, and the loss's options for the rest."""
    spec = {name: keywords.pop(name) for name in list(keywords) if name in SPEC_FIELDS}
    return LossSpec(**spec | {"loss": make_loss(spec.get("loss", "grpo"), **keywords)})


def step_inputs(step: dict, dtype: torch.dtype | None = None, *, group: bool = True, **tensors) -> LossInputs:
    """The `LossInputs` of a `make_step` dict (``old`` the proximal log-probs, ``adv``, ``mask``,
    ``doc``, ``group``, and ``behav``/``ref`` when asked for by ``tensors``); ``dtype`` casts the
    log-probs and advantages; ``tensors`` replace fields."""
    inputs = LossInputs(proximal_logprobs=step["old"], advantages=step["adv"], mask=step["mask"],
                        document_index=step["doc"], group_index=step["group"] if group else None)
    if dtype is not None:
        inputs = replace(inputs, proximal_logprobs=step["old"].to(dtype), advantages=step["adv"].to(dtype))
    return replace(inputs, **tensors)
