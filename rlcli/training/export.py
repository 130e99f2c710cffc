"""Writing the policy in Hugging Face format, gathered from every shard."""

from __future__ import annotations

from pathlib import Path

from rlcli.errors import UserError
from rlcli.training import distributed


def export_policy(module, trainer, export_dir: Path, model_cfg) -> None:
    """Write the trained policy in Hugging Face format (safetensors), gathered from every shard.

    Called on every rank. Policy weights that hold a NaN or an infinity are never written: every
    rank raises `UserError` instead.
    """
    from rlcli.model.policy import save_tokenizer_if_any

    if not distributed.all_finite(module.scorer.parameters(), module.device):
        raise UserError(f"not writing the policy to {export_dir}: after step {module.steps_done} its parameters "
                        "hold NaN or infinite values")
    prefix = "scorer.policy."
    full = trainer.strategy.lightning_module_state_dict()  # a collective for sharded strategies
    if trainer.is_global_zero:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        state = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
        module.policy.save_pretrained(export_dir, state_dict=state)
        save_tokenizer_if_any(model_cfg, export_dir)
