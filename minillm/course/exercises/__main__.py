"""``python -m minillm.course.exercises build [--check]``: regenerate ``exercises/`` from ``solutions/``.

``python -m minillm.course.exercises nbgrader DIR [--demo ASSIGNMENT ...]``: write an nbgrader course directory
built from ``solutions/`` (see :mod:`minillm.course.exercises.nbgrader`); with ``--demo``, also grade three sample
students on those assignments with nbgrader (the ``[classroom]`` extra).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minillm.course.exercises.build import build_all

# The repository's folders, wherever the command runs from (the package is installed from the repository, editable).
REPO = Path(__file__).resolve().parents[3]


def _default(folder: str) -> Path:
    """``folder`` (``solutions``, ``exercises``) in the working directory if it is there, else the repository's."""
    here = Path(folder)
    return here if here.is_dir() else REPO / folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.course.exercises")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write exercises/*.ipynb from solutions/*.ipynb")
    b.add_argument("--check", action="store_true", help="write nothing; exit 1 if exercises/ is out of date")
    b.add_argument("--solutions", type=Path, default=_default("solutions"))
    b.add_argument("--exercises", type=Path, default=_default("exercises"))
    g = sub.add_parser("nbgrader", help="write an nbgrader course directory (source/ and nbgrader_config.py) "
                                        "from solutions/*.ipynb")
    g.add_argument("dir", type=Path, help="the course directory (created if needed)")
    g.add_argument("--solutions", type=Path, default=_default("solutions"),
                   help="the solution notebooks (default: ./solutions, else the repository's)")
    g.add_argument("--demo", nargs="+", metavar="ASSIGNMENT",
                   help="then generate these assignments and autograde three sample students on them "
                        "(sample_solved, sample_unsolved, sample_half) with nbgrader")
    args = parser.parse_args(argv)
    if args.command == "nbgrader":
        from minillm.course.exercises.nbgrader import build_course, run_demo

        if args.demo:
            unknown = [a for a in args.demo if not (args.solutions / f"{a}.ipynb").exists()]
            if unknown:
                parser.error(f"no solution notebook for {unknown}; the assignments are "
                             f"{sorted(p.stem for p in args.solutions.glob('*.ipynb'))}")
        try:
            if args.demo:
                run_demo(args.dir, args.demo, args.solutions)
            else:
                for path in build_course(args.dir, args.solutions):
                    print("wrote " + str(path))
        except ValueError as e:  # a solution notebook whose exercises or points are malformed
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    stale = build_all(args.solutions, args.exercises, check=args.check)
    for path in stale:
        print(("out of date: " if args.check else "wrote ") + str(path))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
