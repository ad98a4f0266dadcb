"""``python -m minillm.exercises build [--check]``: regenerate ``exercises/`` from ``solutions/``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minillm.exercises.build import build_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.exercises")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write exercises/*.ipynb from solutions/*.ipynb")
    b.add_argument("--check", action="store_true", help="write nothing; exit 1 if exercises/ is out of date")
    b.add_argument("--solutions", type=Path, default=Path("solutions"))
    b.add_argument("--exercises", type=Path, default=Path("exercises"))
    args = parser.parse_args(argv)
    stale = build_all(args.solutions, args.exercises, check=args.check)
    for path in stale:
        print(("out of date: " if args.check else "wrote ") + str(path))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
