"""Write the index of vLLM's source that ``tests/test_vllm_references.py`` checks the course's citations against.

The course maps to one vLLM release (see COURSE.md, "Which vLLM"). The test must run offline and fast, so instead of
the 340 MB wheel it reads a small committed index: every ``vllm/**/*.py`` path, and for each file the names a
learner could look for there. The index is made with ``ast`` only: vLLM is never imported (or installed).

How to run it (from the repository root)::

    d=$(mktemp -d) && pip download vllm==0.33.0 --no-deps -d $d && (cd $d && unzip -q vllm-0.33.0-*.whl)
    python scripts/vllm_index.py $d --version 0.33.0      # writes tests/data/vllm-0.33.0-index.json

``$d`` is the directory holding the unpacked ``vllm/`` package (the wheel's root). Re-run it, and change the
version the test reads, when the course moves to another release.

Format: JSON, one line per file, sorted, so that the committed file stays small (about 1.7 MB) and a diff between
releases reads well. Each file's names are one space-separated string, not a list: quotes and commas around 90,000
names would add 0.2 MB::

    {"version": "0.33.0",
     "files": {
      "vllm/v1/core/sched/scheduler.py": "logger Scheduler: _preempt_request ... schedule ... waiting",
      ...}}

- First the top-level names the file defines other than classes: functions and assigned names (constants, type
  aliases, loggers), including those defined under ``if``/``try``/``with`` blocks (vLLM defines many names
  conditionally: platform checks, ``try: import x except ImportError: x = None``).
- Then each top-level class as ``Class:`` followed by its members: methods, nested classes, class attributes and
  annotated fields (dataclass / pydantic fields), and the ``self.x`` attributes its methods assign (a learner looks
  for ``Request.num_computed_tokens`` in ``Request`` whether it is a field or set in ``__init__``). Dunder methods
  other than ``__init__``, ``__post_init__`` and ``__call__`` are left out: nobody cites ``Foo.__repr__``.
Imported names are left out (1 MB): a name is cited where it is defined, and the test finds that file by itself.
A name never contains a space or a colon, so the string parses back unambiguously (the test's ``_parse_entry``).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _target_names(target: ast.expr) -> list[str]:
    """Plain names bound by an assignment target (``a = ...``, ``a, b = ...``); attributes and subscripts bind none."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _bound_names(stmt: ast.stmt) -> list[str]:
    """Names a statement defines in the scope it runs in (module or class body)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n for t in stmt.targets for n in _target_names(t)]
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return _target_names(stmt.target)
    type_alias = getattr(ast, "TypeAlias", None)  # Python 3.12's `type X = ...`; absent from older Pythons' ast
    if type_alias is not None and isinstance(stmt, type_alias):
        return _target_names(stmt.name)
    return []


def _nested_bodies(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """Bodies whose definitions still land in the enclosing scope: ``if``/``try``/``with``/``for`` blocks.

    vLLM defines many names conditionally (``if TYPE_CHECKING:``, ``try: import x except ImportError: x = None``,
    platform checks); they are defined in the file all the same.
    """
    if isinstance(stmt, (ast.If, ast.For, ast.AsyncFor, ast.While)):
        return [stmt.body, stmt.orelse]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return [stmt.body]
    if isinstance(stmt, ast.Try) or (sys.version_info >= (3, 11) and isinstance(stmt, ast.TryStar)):
        return [stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody]
    if isinstance(stmt, ast.Match):
        return [case.body for case in stmt.cases]
    return []


def _walk_scope(body: list[ast.stmt]):
    """Every statement that runs in this scope, descending into blocks but not into functions or classes."""
    for stmt in body:
        yield stmt
        for sub in _nested_bodies(stmt):
            yield from _walk_scope(sub)


# Dunders a citation may name (the constructor, the dataclass hook, a callable's body); the rest is noise.
KEPT_DUNDERS = frozenset({"__init__", "__post_init__", "__call__"})


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """``self.x`` names assigned in the class's own methods (instance attributes, the state a learner reads)."""
    names: set[str] = set()
    for stmt in cls.body:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) or not stmt.args.args:
            continue
        self_name = stmt.args.args[0].arg  # usually `self`; `cls` for classmethods, which set class attributes
        for node in ast.walk(stmt):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for sub in ast.walk(target):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id == self_name):
                        names.add(sub.attr)
    return names


def index_source(source: str, filename: str = "<vllm>") -> str:
    """One file's entry: its top-level non-class names, then ``Class: member ...`` per top-level class."""
    tree = ast.parse(source, filename=filename)
    top: set[str] = set()
    classes: dict[str, set[str]] = {}
    for stmt in _walk_scope(tree.body):
        top.update(_bound_names(stmt))
        if isinstance(stmt, ast.ClassDef):
            # A class defined twice (e.g. per platform) is one class to a reader: merge the members.
            members = classes.setdefault(stmt.name, set())
            for inner in _walk_scope(stmt.body):
                members.update(_bound_names(inner))
            members.update(_self_attributes(stmt))
    words = sorted(top - classes.keys())
    for name, members in sorted(classes.items()):
        kept = (m for m in members if not (m.startswith("__") and m.endswith("__")) or m in KEPT_DUNDERS)
        words.append(f"{name}:")
        words.extend(sorted(kept))
    return " ".join(words)


def build_index(root: Path, version: str) -> dict:
    """Index every ``vllm/**/*.py`` under ``root`` (the directory that holds the ``vllm`` package)."""
    package = root / "vllm"
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"{root} does not hold an unpacked vllm package (no {package / '__init__.py'})")
    files: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        try:
            files[rel] = index_source(path.read_text(encoding="utf-8"), rel)
        except SyntaxError as exc:  # keep the path (it exists), say why its names are missing
            print(f"warning: {rel}: {exc}; indexed without names", file=sys.stderr)
            files[rel] = ""
    return {"version": version, "files": files}


def dump_index(index: dict) -> str:
    """Compact JSON with one file per line, sorted, so the committed file stays small and diffs well."""
    lines = [f'{{"version": {json.dumps(index["version"])},', ' "files": {']
    items = sorted(index["files"].items())
    for k, (path, entry) in enumerate(items):
        sep = "," if k < len(items) - 1 else ""
        lines.append(f"  {json.dumps(path)}: {json.dumps(entry)}{sep}")
    lines.append("}}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="directory holding the unpacked vllm/ package (the wheel's root)")
    parser.add_argument("--version", default="0.33.0", help="the vLLM release unpacked there")
    parser.add_argument("--out", type=Path, default=None,
                        help="output file (default tests/data/vllm-<version>-index.json)")
    args = parser.parse_args(argv)
    out = args.out or REPO / "tests" / "data" / f"vllm-{args.version}-index.json"
    index = build_index(args.root, args.version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_index(index), encoding="utf-8")
    n_names = sum(len(entry.split()) for entry in index["files"].values())
    print(f"{out}: {len(index['files'])} files, {n_names} names, {out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
