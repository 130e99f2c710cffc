"""report.html: one self-contained file with the groups, the plots, the manifests' differences and completions."""

import base64
import io
import json
from html.parser import HTMLParser

from report_members import on_policy, write_member
from rich.console import Console

from rlcli.report.command import write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Links(HTMLParser):
    """Every src and href of the page, the tags used, and the text of its table cells."""

    def __init__(self):
        super().__init__()
        self.links, self.tags, self.cells, self._in_cell = [], set(), [], False

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.links += [(tag, value) for name, value in attrs if name in ("src", "href")]
        self._in_cell = self._in_cell or tag == "td"

    def handle_endtag(self, tag):
        self._in_cell = self._in_cell and tag != "td"

    def handle_data(self, data):
        if self._in_cell:
            self.cells.append(data)


def manifest(commit: str, torch: str, started: str, seed: int) -> dict:
    """The keys of rlcli.manifest's manifest.json that matter here."""
    return {"started": started, "rlcli": {"version": "0.1"}, "git": {"commit": commit, "dirty": False},
            "packages": {"torch": torch, "numpy": "2.0"}, "hardware": {"cpus": 2}, "argv": ["rlcli", f"seed={seed}"],
            "overrides": [f"seed={seed}"], "slurm": {"job_id": started}}


def sweep(path):
    """grpo and gspo with seeds 0 and 1 (different curves); manifests differ in git.commit and packages.torch,
    and in the keys never compared; member 3 has no manifest; member 0 has 5 lines of completions."""
    commits = ["aaa", "aaa", "bbb"]
    for i, (loss, seed) in enumerate([("grpo", 0), ("grpo", 1), ("gspo", 0), ("gspo", 1)]):
        member = path / str(i)
        write_member(member, [f"loss={loss}", f"seed={seed}"], on_policy([0.1 * i, 0.2 * i], [0.5, 0.1 * i]))
        if i < 3:
            info = manifest(commits[i], "2.4" if i else "2.5", f"21:0{i}", seed)
            (member / "manifest.json").write_text(json.dumps(info))
    lines = [{"step": s, "prompt": f"prompt {s}", "completion": f"<b>answer {s}</b>", "reward": 1.0,
              "advantage": 0.5, "length": 3} for s in range(1, 6)]
    (path / "0" / "completions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (path / "2" / "completions.jsonl").write_text('{"step": 1, "completion_ids": [5, 6], "reward": 0.0}\n{"step": 2')


def test_report_html_is_self_contained_and_holds_the_groups(tmp_path):
    """No src or href leaves the file: every image is a PNG data URI (fails with a file link or a CDN script);
    the group table names both groups and their seeds."""
    sweep(tmp_path)
    report = write_report(tmp_path, console=Console(file=io.StringIO(), width=300))
    html = (tmp_path / "report.html").read_text()
    page = Links()
    page.feed(html)

    assert page.links and all(tag == "img" for tag, _ in page.links)
    for _, src in page.links:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.removeprefix("data:image/png;base64,"))[:8] == PNG_SIGNATURE
    assert "http://" not in html and "https://" not in html
    assert "link" not in page.tags and "<script src" not in html
    group_plots = [p for p in report.plots if p.name.startswith("report_group_")]
    assert group_plots and len(page.links) == len(report.plots)  # the members' plots and the groups'
    assert {"G1", "G2", "loss=grpo", "loss=gspo", "0 1"} <= set(page.cells)
    assert "P(row better than column)" in html


def test_report_html_lists_what_differs_between_manifests(tmp_path):
    """git.commit and packages.torch differ (with the members of each value); started, argv, overrides and
    slurm ids differ in every sweep and are left out; a member without manifest.json is named."""
    sweep(tmp_path)
    write_report(tmp_path, console=Console(file=io.StringIO(), width=300))
    page = Links()
    page.feed((tmp_path / "report.html").read_text())
    assert "git.commit" in page.cells and "packages.torch" in page.cells
    assert '"bbb" ' in page.cells and "(members 0, 1)" in page.cells  # each value, and who has it
    for key in ("started", "argv", "overrides", "slurm.job_id", "packages.numpy", "hardware.cpus"):
        assert key not in page.cells
    assert "Members without manifest.json: 3." in (tmp_path / "report.html").read_text()


def test_report_html_shows_the_last_completions_per_group(tmp_path):
    """The last 3 of member 0's 5 lines (escaped text), and for G2 member 2's token ids and its half-written
    last line; nothing without completions.jsonl is invented."""
    sweep(tmp_path)
    write_report(tmp_path, console=Console(file=io.StringIO(), width=300))
    html = (tmp_path / "report.html").read_text()
    assert "prompt 3" in html and "prompt 5" in html and "prompt 2" not in html
    assert "&lt;b&gt;answer 5&lt;/b&gt;" in html and "<b>answer" not in html
    assert "[5, 6]" in html and "unreadable line" in html
