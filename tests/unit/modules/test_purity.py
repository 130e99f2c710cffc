"""`rlcli.modules` is pure tensor math: no Lightning, Hugging Face, Hydra, torch.distributed, or other rlcli."""

from __future__ import annotations

import ast
from pathlib import Path

import rlcli.modules

MODULES = Path(rlcli.modules.__file__).parent
FORBIDDEN_PACKAGES = ("lightning", "transformers", "hydra", "omegaconf")


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module or ""))
    return found


def is_forbidden(name: str) -> bool:
    top = name.split(".")[0]
    return (top in FORBIDDEN_PACKAGES or name == "torch.distributed" or name.startswith("torch.distributed.")
            or (top == "rlcli" and name != "rlcli.modules" and not name.startswith("rlcli.modules.")))


def test_the_checker_catches_each_kind_of_forbidden_import():
    source = ("import lightning as L\nfrom transformers import AutoModel\nimport torch.distributed as dist\n"
              "from rlcli.training import step\nfrom rlcli.modules.segments import Segments\nimport torch\n")
    bad = [name for _, name in imported_names(ast.parse(source)) if is_forbidden(name)]
    assert bad == ["lightning", "transformers", "torch.distributed", "rlcli.training"]


def test_every_file_of_rlcli_modules_imports_only_pure_math():
    files = sorted(MODULES.rglob("*.py"))
    assert len(files) >= 8
    offending = [
        f"{path.relative_to(MODULES.parent)}:{line} imports {name}"
        for path in files
        for line, name in imported_names(ast.parse(path.read_text()))
        if is_forbidden(name)
    ]
    assert offending == []
