"""``metrics.csv`` in the run directory: one row per optimizer step, a ``step`` column first."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from rlcli.storage import replace_text


class MetricsCSVLogger(Logger):
    """A Lightning logger that keeps every row and rewrites the header when a new metric appears."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.columns: list[str] = ["step"]
        self.rows: list[dict] = []

    @property
    def name(self) -> str:
        return "metrics_csv"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        """The resolved config is saved as ``config.yaml`` by `rlcli train`; nothing to do here."""

    @rank_zero_only
    def resume_at(self, step: int) -> None:
        """Keep the rows of steps up to ``step`` from an earlier run in the same file; the steps
        after it are trained again and logged anew."""
        if not self.path.is_file():
            return
        with self.path.open(newline="") as f:
            reader = csv.DictReader(f)
            self.columns = list(reader.fieldnames or ["step"])
            self.rows = [row for row in reader if int(row["step"]) <= step]
        self._write(self.rows, mode="w", header=True)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = {"step": step, **metrics}
        new_columns = [k for k in row if k not in self.columns]
        self.columns += new_columns
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if new_columns or len(self.rows) == 1:
            self._write(self.rows, mode="w", header=True)
        else:
            self._write([row], mode="a", header=False)

    def _write(self, rows: list[dict], mode: str, header: bool) -> None:
        """Append ``rows`` (``mode="a"``), or replace the file with ``rows`` atomically (``"w"``): a kill
        while the header changes or a resumed run cuts the file back never leaves it empty."""
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.columns)
        if header:
            writer.writeheader()
        writer.writerows(rows)
        if mode == "w":
            replace_text(self.path, text.getvalue())
        else:
            with self.path.open("a", newline="") as f:
                f.write(text.getvalue())
