"""What differs between the members' ``manifest.json`` (code, packages, hardware, ...), key by key."""

from __future__ import annotations

import json

from rlcli.report.runs import ReportError, Run

__all__ = ["NOT_COMPARED", "differences", "flatten", "read_manifest"]

# keys left out, and why: they differ between the members of any sweep, so they would hide the differences
# that matter (another commit, another package version, other hardware)
NOT_COMPARED = {
    "started": "a start time differs in every run",
    "ended": "an end time differs in every run",
    "hostname": "members run on different nodes; the hardware keys show when those differ",
    "command": "the overrides differ by design; the group tables show them",
    "overrides": "the overrides differ by design; the group tables show them",
    "slurm": "job and array ids differ by design",
}


def read_manifest(run: Run) -> dict | None:
    """A member's ``manifest.json``, ``None`` without that file; raises `ReportError` for one that is not
    a JSON object."""
    path = run.path / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ReportError(f"{path}: not JSON: {err}") from None
    if not isinstance(manifest, dict):
        raise ReportError(f"{path}: expected a JSON object")
    return manifest


def flatten(value, prefix: str = "") -> dict[str, str]:
    """Nested objects as ``{"a.b.c": value as JSON}``; a list is one value."""
    if isinstance(value, dict) and value:
        flat = {}
        for key, inner in value.items():
            flat |= flatten(inner, f"{prefix}.{key}" if prefix else str(key))
        return flat
    return {prefix: json.dumps(value)}


def _compared(key: str) -> bool:
    parts = key.split(".")
    return parts[0] not in NOT_COMPARED and parts[-1] not in NOT_COMPARED


def differences(manifests: dict[str, dict]) -> dict[str, dict[str, str]]:
    """Key -> {member: value as JSON, or "(absent)"} for each compared key whose value is not the same in
    every member of ``manifests`` (member name -> manifest); sorted by key."""
    flat = {member: flatten(manifest) for member, manifest in manifests.items()}
    keys = sorted({key for values in flat.values() for key in values if _compared(key)})
    found = {}
    for key in keys:
        values = {member: values.get(key, "(absent)") for member, values in flat.items()}
        if len(set(values.values())) > 1:
            found[key] = values
    return found
