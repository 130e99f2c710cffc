"""`rlcli report`: plots of a run, the summary table of a multirun, --out and the error exit code."""

import csv
import io
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from rlcli.cli import main
from rlcli.report.command import _member_labels, write_report
from rlcli.report.runs import ReportError, find_runs, read_metrics
from rlcli.report.summary import print_summary, summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = ["loss", "reward", "accuracy", "ratio_new_old", "kl_new_old", "clipped_ratio_fraction",
             "entropy", "grad_norm", "num_documents"]
RUN_PLOTS = [m for m in ALL_PLOTS if m not in ("reward", "accuracy", "entropy")]

# member -> (overrides, columns of metrics.csv with None for an empty cell, has export/)
MEMBERS = {
    "0": (
        ["loss=grpo", "aggregation=token_mean", "trainer.max_steps=4"],
        {
            "step": [1, 2, 3, 4],
            "loss": [0.5, 0.2, 0.3, 0.25],
            "num_documents": [8, 8, 7, 8],
            "grad_norm": [1.5, 1.25, 1.0, 0.75],
            "ratio_new_old": [1.0, 1.01, 0.99, 1.02],
            "kl_new_old": [0.02, 0.01, 0.03, 0.015],
            "clipped_ratio_fraction": [0.0, 0.1, 0.2, 0.05],
            "entropy": [2.5, 2.25, 2.0, 1.75],
            "reward": [0.1, 0.4, 0.3, None],  # the last step has no reward: final is 0.3
            "accuracy": [0.0, 0.5, 0.25, 0.5],
        },
        True,
    ),
    "1": (
        ["loss=gspo", "aggregation=constant", "trainer.max_steps=4"],
        {
            "step": [1, 2, 3],
            "loss": [-0.1, -0.3, -0.2],
            "num_documents": [8, 8, 8],
            "grad_norm": [2.0, None, 1.0],
            "ratio_new_old": [1.0, 0.98, 0.97],
            "kl_new_old": [0.05, 0.04, 0.06],
            "clipped_ratio_fraction": [0.3, 0.2, 0.1],
        },
        False,
    ),
    "10": (
        ["loss=gspo", "aggregation=token_mean", "trainer.max_steps=4"],
        {
            "step": [1, 2],
            "loss": [0.7, 0.6],
            "num_documents": [4, 4],
            "grad_norm": [0.5, 0.5],
            "ratio_new_old": [1.0, 1.0],
            "kl_new_old": [0.0, 0.001],
            "clipped_ratio_fraction": [0.0, 0.0],
        },
        True,
    ),
}
KEY_METRICS = {"loss": "min", "reward": "max", "accuracy": "max", "ratio_new_old": None,
               "kl_new_old": "min", "entropy": None}


def write_run(run_dir: Path, overrides: list[str] | None, columns: dict | None, export: bool = False) -> Path:
    run_dir.mkdir(parents=True)
    if overrides is not None:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides) or "[]\n")
    if columns is not None:
        with (run_dir / "metrics.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            writer.writerows(["" if v is None else repr(v) for v in row] for row in zip(*columns.values()))
    if export:
        (run_dir / "export").mkdir()
    return run_dir


@pytest.fixture
def run_dir(tmp_path):
    overrides, columns, _ = MEMBERS["1"]
    return write_run(tmp_path / "run", overrides, columns)


@pytest.fixture
def multirun(tmp_path):
    path = tmp_path / "multirun"
    for name, (overrides, columns, export) in MEMBERS.items():
        write_run(path / name, overrides, columns, export)
    write_run(path / "2", ["loss=grpo", "aggregation=constant", "trainer.max_steps=4"], None)  # failed
    write_run(path / "3", [], None).joinpath("metrics.csv").write_text("step,loss\n1,abc\n")
    (path / "multirun.yaml").write_text("hydra: {}\n")
    (path / "notes").mkdir()  # not a member: its name is not a number
    return path


def console():
    return Console(file=io.StringIO(), width=250, color_system=None)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 100 and height > 100, path
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size == (width, height)


def expected_row(name: str) -> dict[str, str]:
    """The summary row of a member, computed here from MEMBERS (numbers as floats)."""
    overrides, columns, export = MEMBERS[name]
    row = {"member": name, "status": "done" if export else "partial", "overrides": " ".join(overrides),
           "steps": str(columns["step"][-1])}
    for metric, rule in KEY_METRICS.items():
        values = [v for v in columns.get(metric, []) if v is not None]
        row[f"{metric}_final"] = values[-1] if values else ""
        if rule:
            row[f"{metric}_best_{rule}"] = (min(values) if rule == "min" else max(values)) if values else ""
    return row


def numbers(row: dict[str, str]) -> dict[str, str | float]:
    return {k: float(v) if k.endswith(("_final", "_min", "_max")) and v != "" else v for k, v in row.items()}


def test_run_directory_gets_a_plot_per_present_metric(run_dir):
    con = console()
    report = write_report(run_dir, console=con)

    assert report.kind == "run"
    assert [p.name for p in report.plots] == [f"report_{m}.png" for m in RUN_PLOTS]
    assert report.skipped == ["reward", "accuracy", "entropy"]
    for metric in RUN_PLOTS:
        assert_png(run_dir / f"report_{metric}.png")
    for metric in report.skipped:
        assert not (run_dir / f"report_{metric}.png").exists()
    assert not (run_dir / "summary.csv").exists()
    assert "skipped (no values in metrics.csv): reward, accuracy, entropy" in con.file.getvalue()


def test_multirun_summary_rows_match_the_members_metrics(multirun):
    con = console()
    report = write_report(multirun, console=con)

    assert report.kind == "multirun"
    assert [r.name for r in report.runs] == ["0", "1", "2", "3", "10"]
    assert report.skipped == []
    for metric in ALL_PLOTS:
        assert_png(multirun / f"report_{metric}.png")

    with (multirun / "summary.csv").open(newline="") as f:
        rows = {row["member"]: row for row in csv.DictReader(f)}
    assert list(rows) == ["0", "1", "2", "3", "10"]
    groups = {"0": "G1", "10": "G5"}  # every member is a configuration of its own, numbered in member order
    for name in MEMBERS:
        assert numbers(rows[name]) == {**expected_row(name), "group": groups.get(name, f"G{int(name) + 1}")}
    assert rows["0"]["reward_final"] == "0.3"  # the last non-empty reward
    assert rows["2"]["status"] == "no metrics"
    assert rows["2"]["overrides"] == "loss=grpo aggregation=constant trainer.max_steps=4"
    assert {v for k, v in rows["2"].items() if k not in ("member", "status", "overrides", "group")} == {""}
    assert rows["3"]["status"].startswith("unreadable: ")
    assert "metrics.csv:2: column 'loss': 'abc' is not a number" in rows["3"]["status"]

    markdown = (multirun / "summary.md").read_text()
    assert "| member | status | overrides | steps | loss_final | loss_best_min | reward_final |" in markdown
    assert "| 2 | no metrics | loss=grpo aggregation=constant trainer.max_steps=4 | " in markdown
    row_0 = "| 0 | done | loss=grpo aggregation=token_mean trainer.max_steps=4 | 4 | 0.25 | 0.2 | 0.3 | 0.4 |"
    assert row_0 in markdown
    assert "best = min for loss and kl_new_old, max for reward and accuracy" in markdown

    printed = con.file.getvalue()
    assert "no metrics" in printed and "unreadable" in printed
    assert "wrote summary.csv, summary.md, groups.csv and report.html" in printed


def test_legend_labels_show_the_overrides_that_differ(multirun):
    _, runs = find_runs(multirun)
    assert _member_labels(runs) == [
        "0: loss=grpo aggregation=token_mean trainer.max_steps=4",  # "3" has no overrides: nothing is shared
        "1: loss=gspo aggregation=constant trainer.max_steps=4",
        "2: loss=grpo aggregation=constant trainer.max_steps=4",
        "3",
        "10: loss=gspo aggregation=token_mean trainer.max_steps=4",
    ]
    plotted = [r for r in runs if r.metrics is not None]
    assert _member_labels(plotted) == [
        "0: loss=grpo aggregation=token_mean",  # trainer.max_steps=4 is shared
        "1: loss=gspo aggregation=constant",
        "10: loss=gspo aggregation=token_mean",
    ]


def test_cli_writes_into_out_dir(multirun, tmp_path):
    out = tmp_path / "out" / "report"
    env = {**os.environ, "COLUMNS": "250"}
    result = subprocess.run([sys.executable, "-m", "rlcli", "report", str(multirun), "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=60)

    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["summary.csv", "summary.md", "groups.csv", "report.html"] + [f"report_{m}.png" for m in ALL_PLOTS])
    assert not list(multirun.glob("report_*.png")) and not list(multirun.glob("summary.*"))
    for metric in ALL_PLOTS:
        assert_png(out / f"report_{metric}.png")
    assert "no metrics" in result.stdout


@pytest.mark.parametrize("make", ["empty", "missing", "file", "numbered_without_metrics"])
def test_neither_run_nor_multirun_exits_2_with_one_message(tmp_path, capsys, make):
    path = tmp_path / "x"
    if make == "empty":
        path.mkdir()
    elif make == "file":
        path.write_text("step,loss\n")
    elif make == "numbered_without_metrics":
        write_run(path / "0", ["loss=grpo"], None)

    with pytest.raises(ReportError):
        write_report(path, console=console())
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcli report: error: ") and err.count("\n") == 1
    assert not list(tmp_path.glob("**/report_*.png"))


def test_cli_error_exit_code_in_a_subprocess(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlcli", "report", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "is neither a run directory" in result.stderr and "Traceback" not in result.stderr


def test_read_metrics_empty_cells_and_partly_written_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,loss,grad_norm\n1,0.5,\n2,0.25,1.0\n,0.1\n")
    metrics = read_metrics(path)
    assert metrics["step"] == [1.0, 2.0] and metrics["loss"] == [0.5, 0.25]
    assert metrics["grad_norm"][0] != metrics["grad_norm"][0] and metrics["grad_norm"][1] == 1.0  # NaN, 1.0


@pytest.mark.parametrize("width", [60, 250])
def test_console_summary_fits_the_console_width(multirun, width):
    con = Console(file=io.StringIO(), width=width, color_system=None)
    print_summary(summarize(find_runs(multirun)[1]), "Multirun", con)
    printed = con.file.getvalue()
    assert max(len(line.rstrip()) for line in printed.splitlines()) <= width
    assert "no metrics" in printed and "-0.3" in printed  # member 1's best loss, never cut
    assert ("loss_best_min=-0.3" in printed) == (width == 60)  # too narrow for the table: one block per member
