"""Hydra config groups of `rlcli train` (YAML files shipped as package data) and their schema."""

import warnings
from importlib.resources import files

from omegaconf import OmegaConf

from rlcli.errors import UserError


def example_path(name: str) -> str:
    """Path of a file shipped in ``rlcli/examples`` (used as ``${rlcli_example:NAME}``)."""
    return str(files("rlcli.examples") / name)


def ratio_denominator(correction_mode: str) -> str:
    """The default of ``loss.old_logprobs``: ``recompute`` when a mismatch correction needs the
    trainer's own log-probs, else ``sampler``."""
    return "sampler" if correction_mode == "none" else "recompute"


def gpus_per_node(accelerator: str, devices: int) -> int | None:
    """The GPUs a Slurm job asks of each node (``hydra.launcher.gpus_per_node``): one per process, none
    (no ``--gpus-per-node`` at all) for a CPU run."""
    return None if accelerator == "cpu" else devices


def group_options() -> dict[str, list[str]]:
    """``{group: [option, ...]}`` of the config directory (``rlcli/conf/<group>/<option>.yaml``), sorted."""
    conf = files("rlcli.conf")
    return {entry.name: sorted(f.name.removesuffix(".yaml") for f in entry.iterdir() if f.name.endswith(".yaml"))
            for entry in sorted(conf.iterdir(), key=lambda e: e.name)
            if entry.is_dir() and not entry.name.startswith("_")}


def quiet_local_config_folder() -> None:
    """The local config folder on Hydra's search path (``rlcli_local/``) is optional: no warning without it."""
    warnings.filterwarnings("ignore", message=r"provider=hydra\.searchpath in main, path=rlcli_local")


def build_target(spec: dict, key: str):
    """The object a validated config node's ``_target_`` names, built with its arguments; a failure
    (a wrong target or argument) is the user's to fix: `UserError` naming ``key``."""
    from hydra.utils import instantiate

    try:
        return instantiate(spec)
    except Exception as err:
        if isinstance(err.__cause__, UserError):  # the object's own message (e.g. a task's data errors)
            raise err.__cause__ from None
        raise UserError(f"{key}: cannot build {spec.get('_target_')}: {err}") from None


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("rlcli_example", example_path, replace=True)
    OmegaConf.register_new_resolver("rlcli_ratio_denominator", ratio_denominator, replace=True)
    OmegaConf.register_new_resolver("rlcli_gpus_per_node", gpus_per_node, replace=True)


register_resolvers()
