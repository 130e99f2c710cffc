"""``rlcli report``: plots of a run's ``metrics.csv``; for a Hydra multirun, tables of its members and of its
configurations over seeds, and ``report.html``."""

from rlcli.report.command import Report, report_command, write_report
from rlcli.report.runs import ReportError

__all__ = ["Report", "ReportError", "report_command", "write_report"]
