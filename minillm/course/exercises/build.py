"""Turn ``solutions/*.ipynb`` into ``exercises/*.ipynb`` by stripping solution regions and clearing outputs."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_TITLE = re.compile(r"^#\s*((?:Exercise\s+\d+\.\d+|Challenge\s+\d+)\s*:.*)$")


def strip_solutions(source: str) -> str:
    """Replace every ``### BEGIN SOLUTION ... ### END SOLUTION`` region of a cell with a ``NotImplementedError``.

    The message is the cell's ``# Exercise N.M: ...`` (or ``# Challenge N: ...``) title line. Raises ``ValueError`` on unbalanced markers or a
    missing title, so a malformed solution notebook cannot silently produce a broken exercise.
    """
    lines = source.splitlines()
    title = next((m.group(1).strip() for m in map(_TITLE.match, lines) if m), None)
    if title is None:
        raise ValueError(f"a cell with {BEGIN!r} must start with a '# Exercise N.M: ...' or '# Challenge N: ...' line:\n{source[:200]}")
    out: list[str] = []
    inside = False
    for line in lines:
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r} in exercise {title!r}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}raise NotImplementedError({title!r})")
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r} in exercise {title!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r} in exercise {title!r}")
    return "\n".join(out)


def build_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The exercise version of a solution notebook: solution regions stripped, every output cleared."""
    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if BEGIN in cell.source:
            cell.source = strip_solutions(cell.source)
        cell.outputs = []
        cell.execution_count = None
        cell.metadata.pop("execution", None)
    return nb


def build_all(solutions: Path = Path("solutions"), exercises: Path = Path("exercises"),
              check: bool = False) -> list[Path]:
    """Build every ``solutions/*.ipynb`` into ``exercises/``; with ``check``, write nothing and return the stale ones."""
    exercises.mkdir(exist_ok=True)
    stale = []
    for src in sorted(solutions.glob("*.ipynb")):
        built = build_notebook(nbformat.read(src, as_version=4))
        text = nbformat.writes(built) + "\n"
        dest = exercises / src.name
        if not dest.exists() or dest.read_text() != text:
            stale.append(dest)
            if not check:
                dest.write_text(text)
    return stale
