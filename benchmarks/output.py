"""How a benchmark hands its result over: its table on stdout, and the result as JSON where asked."""

from __future__ import annotations

import json
from pathlib import Path


def report(result: dict, table: str, json_path: Path | None) -> dict:
    """Print ``table``; write ``result`` to ``json_path`` (if given); return ``result``."""
    print(table)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result
