"""``rlcli report``: plots of a run's ``metrics.csv``; for a Hydra multirun, tables of its members and of its
configurations over seeds, and ``report.html`` (`rlcli.report.command`). The package imports nothing itself:
`rlcli.report.runs`, which the run's objective reads, stays free of SciPy and Matplotlib."""
