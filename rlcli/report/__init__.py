"""``rlcli report``: plots of a run's ``metrics.csv``, and a summary table of a Hydra multirun."""

from rlcli.report.command import Report, report_command, write_report
from rlcli.report.runs import ReportError

__all__ = ["Report", "ReportError", "report_command", "write_report"]
