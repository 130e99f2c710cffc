"""Hydra config groups of `rlcli train` (YAML files shipped as package data) and their schema."""

from importlib.resources import files

from omegaconf import OmegaConf


def example_path(name: str) -> str:
    """Path of a file shipped in ``rlcli/examples`` (used as ``${rlcli_example:NAME}``)."""
    return str(files("rlcli.examples") / name)


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("rlcli_example", example_path, replace=True)


register_resolvers()
