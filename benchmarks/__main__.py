"""``python -m benchmarks [NAME ...]``: run the named benchmarks (all by default) with their
default settings. Each one also runs alone with its own options: ``python -m benchmarks.NAME --help``.
"""

from __future__ import annotations

import sys

from benchmarks import docs_per_step, lm_head

BENCHMARKS = {"lm_head": lm_head.main, "docs_per_step": docs_per_step.main}


def main(argv: list[str] | None = None) -> None:
    names = (sys.argv[1:] if argv is None else argv) or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        sys.exit(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    for name in names:
        print(f"## {name}", flush=True)
        BENCHMARKS[name]([])


if __name__ == "__main__":
    main()
