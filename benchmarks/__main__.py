"""``python -m benchmarks [ARGS]``: run every benchmark (today: the LM head + policy loss).

The arguments are passed on unchanged; ``python -m benchmarks --help`` lists them.
"""

from __future__ import annotations

import sys

from benchmarks import lm_head

BENCHMARKS = {"lm_head": lm_head.main}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for name, run in BENCHMARKS.items():
        print(f"## {name}", flush=True)
        run(argv)


if __name__ == "__main__":
    main()
