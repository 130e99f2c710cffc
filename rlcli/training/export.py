"""Writing the policy in Hugging Face format, gathered from every shard."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from rlcli.errors import UserError
from rlcli.storage import REFUSED_BY_STORAGE, storage_error
from rlcli.training import distributed


def export_policy(module, trainer, export_dir: Path, model_cfg, *, adapter_only: bool = False) -> None:
    """Write the trained policy in Hugging Face format (safetensors), gathered from every shard; with LoRA
    adapters, the merged model, and the adapters alone in peft's format in ``adapter/`` (``adapter_only``: the
    adapters alone, in ``export_dir`` itself).

    Called on every rank. Policy weights that hold a NaN or an infinity are never written: every
    rank raises `UserError` instead. A storage that refuses the files (a full disk) is a `StorageError`.
    """
    from rlcli.model.lora import has_adapters, merged_weights, save_adapter
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
        try:
            if adapter_only:
                save_adapter(module.policy, state, export_dir)
                return
            module.policy.save_pretrained(export_dir, state_dict=merged_weights(module.policy, state))
            if has_adapters(module.policy):
                save_adapter(module.policy, state, export_dir / "adapter")
            save_tokenizer_if_any(model_cfg, export_dir)
        except Exception as err:
            refused = _refused_by_storage(err)
            if refused is None:
                raise
            raise storage_error(export_dir, refused) from None


def _refused_by_storage(err: Exception) -> OSError | None:
    """The `OSError` of a write the storage refused (`rlcli.storage.REFUSED_BY_STORAGE`), from Python's
    own or from safetensors' error, which only quotes it (``I/O error: No space left on device (os error 28)``);
    else None."""
    if isinstance(err, OSError):
        return err if err.errno in REFUSED_BY_STORAGE else None
    quoted = re.search(r"\(os error (\d+)\)", str(err)) if type(err).__name__ == "SafetensorError" else None
    code = int(quoted.group(1)) if quoted else errno.EIO
    return OSError(code, os.strerror(code)) if code in REFUSED_BY_STORAGE else None
