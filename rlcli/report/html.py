"""``report.html``: one self-contained page (plots as data URIs, inline CSS and script, no external URL)."""

from __future__ import annotations

import base64
import json
from html import escape
from pathlib import Path

from rlcli.manifest import ALWAYS_DIFFERENT, MANIFEST, manifest_differences
from rlcli.report.completions import last_completions
from rlcli.report.group_summary import GroupReport
from rlcli.report.runs import ReportError, read_json_object
from rlcli.report.summary import NOTE, Summary, cell_text

__all__ = ["write_html"]

STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 110em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th.sort { cursor: pointer; background: #f0f0f0; }
.equal { background: #fff3cd; border: 1px solid #e0b000; padding: 0.5em 1em; }
.note { color: #444; font-size: 0.9em; }
pre { white-space: pre-wrap; margin: 0; max-width: 60em; }
img { max-width: 100%; }
"""
# click a header to sort its table by that column, again to reverse; cells that start with a number sort as numbers
SCRIPT = """
document.querySelectorAll("th.sort").forEach(function (th) {
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0], i = th.cellIndex, up = th.dataset.up !== "1";
    th.dataset.up = up ? "1" : "0";
    var key = function (row) { var t = row.cells[i].textContent, n = parseFloat(t); return isNaN(n) ? t : n; };
    Array.from(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b);
      var c = typeof x === typeof y ? (x < y ? -1 : x > y ? 1 : 0) : (typeof x === "number" ? -1 : 1);
      return up ? c : -c;
    }).forEach(function (row) { body.appendChild(row); });
  });
});
"""


def _table(summary: Summary, sortable: bool = True) -> str:
    th = "<th class='sort'>" if sortable else "<th>"
    head = "".join(f"{th}{escape(c)}</th>" for c in summary.columns)
    rows = "".join("<tr>" + "".join(f"<td>{escape(cell_text(row[c]))}</td>" for c in summary.columns) + "</tr>"
                   for row in summary.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _images(paths: list[Path]) -> str:
    return "".join(f'<p><img alt="{escape(p.stem)}" src="data:image/png;base64,'
                   f'{base64.b64encode(p.read_bytes()).decode()}"></p>' for p in paths)


def _manifests(groups: GroupReport) -> str:
    manifests, missing, unreadable = {}, [], []
    for run in (run for group in groups.groups for run in group.members):
        try:
            manifest = read_json_object(run.path / MANIFEST)
        except ReportError as err:
            unreadable.append(f"{run.name}: {err}")
            continue
        if manifest is None:
            missing.append(run.name)
        else:
            manifests[run.name] = manifest
    parts = [f"<p class='note'>Not compared, as they differ between the members of any sweep: "
             f"{escape(', '.join(ALWAYS_DIFFERENT))}.</p>"]
    if missing:
        parts.append(f"<p>Members without manifest.json: {escape(', '.join(missing))}.</p>")
    parts += [f"<p>Unreadable: {escape(line)}</p>" for line in unreadable]
    if len(manifests) >= 2:
        found = manifest_differences(manifests)
        if not found:
            parts.append(f"<p>The {len(manifests)} manifests agree on every compared key.</p>")
        else:
            rows = []
            for key, values in found.items():
                by_value: dict[str, list[str]] = {}
                for member, value in values.items():
                    by_value.setdefault("(absent)" if value is None else json.dumps(value), []).append(member)
                cell = "<br>".join(f"{escape(v)} <span class='note'>(members {escape(', '.join(m))})</span>"
                                   for v, m in by_value.items())
                rows.append(f"<tr><td>{escape(key)}</td><td>{cell}</td></tr>")
            parts.append("<table><thead><tr><th>key</th><th>values</th></tr></thead>"
                         f"<tbody>{''.join(rows)}</tbody></table>")
    return "".join(parts)


def _completion(record: dict) -> str:
    main = ("step", "reward", "advantage")
    text = {k: record[k] for k in ("prompt", "completion", "prompt_ids", "completion_ids", "unreadable line")
            if k in record}
    rest = {k: v for k, v in record.items() if k not in main and k not in text}
    cells = "".join(f"<td>{escape(cell_text(record.get(k)))}</td>" for k in main)
    texts = "".join(f"<b>{escape(k)}</b><pre>{escape(v if isinstance(v, str) else json.dumps(v))}</pre>"
                    for k, v in text.items())
    return f"<tr>{cells}<td>{texts}</td><td class='note'>{escape(json.dumps(rest))}</td></tr>"


def _completions(groups: GroupReport) -> str:
    parts = []
    for group in groups.groups:
        for run in group.members:
            records = last_completions(run)
            if records is not None:
                parts.append(f"<h3>{escape(group.id)}: {escape(group.label)} (member {escape(run.name)}, last "
                             f"{len(records)} lines of completions.jsonl)</h3><table><thead><tr><th>step</th>"
                             "<th>reward</th><th>advantage</th><th>text</th><th>other fields</th></tr></thead>"
                             f"<tbody>{''.join(map(_completion, records))}</tbody></table>")
                break
    return "".join(parts) or "<p>No member has completions.jsonl (rollout.log_completions=N writes it).</p>"


def write_html(path: Path, title: str, groups: GroupReport, members: Summary, group_plots: list[Path],
               member_plots: list[Path]) -> None:
    """Write ``report.html`` to ``path``: the group table (sortable), P(improvement), the equal groups, the plots,
    the member table, the manifests' differences and the last completions of each group."""
    notes = "".join(f"<p class='{'equal' if line.startswith('EQUAL') else 'note'}'>{escape(line)}</p>"
                    for line in groups.notes())
    improvement = "" if groups.improvement is None else (
        "<h2>Probability of improvement</h2>" + _table(groups.improvement, sortable=False))
    body = [
        f"<h1>{escape(title)}</h1>",
        "<h2>Groups (members with the same overrides apart from seed)</h2>",
        "<p class='note'>Click a column's header to sort by it.</p>",
        _table(groups.table), notes, improvement,
        "<h2>Curves: mean over seeds, 95% band</h2>" + _images(group_plots) if group_plots else "",
        "<h2>Members</h2>", _table(members), f"<p class='note'>{escape(NOTE)}</p>",
        f"<details><summary>Every member's curves</summary>{_images(member_plots)}</details>",
        "<h2>Manifests: what differs between members</h2>", _manifests(groups),
        "<h2>Last completions</h2>", _completions(groups),
    ]
    path.write_text(f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{escape(title)}</title>"
                    f"<style>{STYLE}</style></head><body>{''.join(body)}<script>{SCRIPT}</script></body></html>\n",
                    encoding="utf-8")
