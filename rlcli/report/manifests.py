"""The members' ``manifest.json`` (which code, packages and machine made each run), read for the report."""

from __future__ import annotations

import json

from rlcli.manifest import MANIFEST
from rlcli.report.runs import ReportError, Run

__all__ = ["read_manifest"]


def read_manifest(run: Run) -> dict | None:
    """A member's manifest, ``None`` without that file; raises `ReportError` for one that is not a JSON object."""
    path = run.path / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ReportError(f"{path}: not JSON: {err}") from None
    if not isinstance(manifest, dict):
        raise ReportError(f"{path}: expected a JSON object")
    return manifest
