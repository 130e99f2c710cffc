"""Which ``_target_`` a config may name: ``_target_`` builds any importable object, so only rlcli's unless
the user trusts more top-level modules in ``allow_targets``. The check reads the name alone: nothing is
imported before it passes. torch and transformers are not trusted by default: their functions load native
libraries (``torch.ops.load_library``), write files (``torch.save``) and run downloaded code (``torch.hub.load``)."""

from __future__ import annotations

from collections.abc import Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

TRUSTED_TARGET_MODULES = ("rlcli",)


def trusted_modules(cfg: DictConfig) -> tuple[str, ...]:
    """The modules whose objects ``cfg`` may build: rlcli's and those of ``allow_targets``."""
    allowed = cfg.get("allow_targets")
    return TRUSTED_TARGET_MODULES + (tuple(allowed) if isinstance(allowed, ListConfig) else ())


def is_trusted(target: str, modules: tuple[str, ...]) -> bool:
    return any(target == m or target.startswith(m + ".") for m in modules)


def _target_paths(node, path: str = "") -> Iterator[tuple[str, object]]:
    """``(key path, value)`` of every ``_target_`` in the config."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            if OmegaConf.is_missing(node, key):
                continue
            child = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                yield child, node[key]
            else:
                yield from _target_paths(node[key], child)
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _target_paths(item, f"{path}[{i}]")


def untrusted_targets(cfg: DictConfig) -> list[str]:
    """A problem line for each ``_target_`` of ``cfg`` outside the trusted modules."""
    allowed = trusted_modules(cfg)
    return [f"{path}: {target!r} is outside the allowed modules ({', '.join(allowed)}); "
            f"to trust it, add allow_targets=[{str(target).split('.')[0]}]"
            for path, target in _target_paths(cfg) if not is_trusted(str(target), allowed)]
