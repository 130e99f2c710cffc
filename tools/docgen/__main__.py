"""``python -m tools.docgen [--check]``: write the generated docs pages, or check that they are current."""

from __future__ import annotations

import argparse
import sys

from tools.docgen import DOCS, rendered, stale


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docgen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args()
    if args.check:
        out_of_date = stale()
        for path in out_of_date:
            print(f"docs/{path} is out of date: run `python -m tools.docgen`", file=sys.stderr)
        return 1 if out_of_date else 0
    for path, text in rendered().items():
        (DOCS / path).write_text(text)
        print(f"wrote docs/{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
