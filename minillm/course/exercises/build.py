"""Turn ``solutions/*.ipynb`` into ``exercises/*.ipynb`` by stripping solution regions and clearing outputs, and
saying, after each notebook's opening cell, what an answer may import (the answer lint's allow-list:
:func:`minillm.course.exercises.lint.allowed_imports_text`)."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_TITLE = re.compile(r"^#\s*((?:Exercise\s+\d+\.\d+|Challenge\s+\d+)\s*:.*)$")
_NUMBER = re.compile(r"^#\s*(?:Exercise\s+(\d+\.\d+)|Challenge\s+(\d+))\s*:")

def answer_number(source: str) -> str | None:
    """The exercise an answer cell answers, from its first line: ``"2.2"`` for ``# Exercise 2.2: ...``, ``"C2"`` for
    ``# Challenge 2: ...``; ``None`` for any other cell."""
    m = _NUMBER.match(source)
    return None if m is None else m.group(1) or f"C{m.group(2)}"


# The cell, after a notebook's opening, that says what an answer may import: its id (stable across builds) and the
# words a solution notebook's own such cell would carry (then none is added).
ALLOWED_IMPORTS_CELL_ID = "allowed-imports"
_ALLOWED_IMPORTS_MARK = "An answer may import:"
_ALLOWED_IMPORTS_ZH = ("**可以导入什么：** 评分前，你的答案会先被读一遍：导入上面没有列出的模块、"
                       "`minillm.course` 或练习要你自己实现的部分，都会被拒绝，答案不会运行。")


def strip_solutions(source: str) -> str:
    """Replace every ``### BEGIN SOLUTION ... ### END SOLUTION`` region of a cell with a ``NotImplementedError``.

    The message is the cell's ``# Exercise N.M: ...`` (or ``# Challenge N: ...``) title line. Raises ``ValueError``
    on unbalanced markers or a missing title, so a malformed solution notebook cannot silently produce a broken
    exercise.
    """
    lines = source.splitlines()
    title = next((m.group(1).strip() for m in map(_TITLE.match, lines) if m), None)
    if title is None:
        raise ValueError(f"a cell with {BEGIN!r} must start with a '# Exercise N.M: ...' or '# Challenge N: ...' "
                         f"line:\n{source[:200]}")
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


def notebook_numbers(nb: nbformat.NotebookNode) -> list[str]:
    """The exercises of a notebook, in order, from its answer cells' title lines: ``"2.1"``, ``"C2"`` for
    ``# Challenge 2: ...``."""
    found = []
    for cell in nb.cells:
        number = answer_number(cell.source) if cell.cell_type == "code" else None
        if number and (BEGIN in cell.source or "raise NotImplementedError" in cell.source):
            found.append(number)
    return found


def allowed_imports_cell(numbers: list[str]) -> nbformat.NotebookNode:
    """The markdown cell that says what an answer to ``numbers`` may import (English, then a Chinese line); no
    nbgrader metadata, as the notebooks' other markdown cells."""
    from minillm.course.exercises.lint import allowed_imports_text

    cell = nbformat.v4.new_markdown_cell(
        "**Imports.** Before an answer runs for a grade, it is read, and refused if it reaches outside its exercise. "
        f"{allowed_imports_text(numbers, markdown=True)}\n\n{_ALLOWED_IMPORTS_ZH}")
    cell.id = ALLOWED_IMPORTS_CELL_ID
    return cell


def with_allowed_imports(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``nb`` with :func:`allowed_imports_cell` after its opening (first) cell, unless it has one already (a cell
    with that id or that says what an answer may import) or has no exercise. Changes ``nb`` and returns it."""
    numbers = notebook_numbers(nb)
    if numbers and not any(c.get("id") == ALLOWED_IMPORTS_CELL_ID or
                           (c.cell_type == "markdown" and _ALLOWED_IMPORTS_MARK in c.source) for c in nb.cells):
        nb.cells.insert(1, allowed_imports_cell(numbers))
    return nb


def build_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The exercise version of a solution notebook: solution regions stripped, every output cleared, and what an
    answer may import said after the opening (:func:`with_allowed_imports`)."""
    nb = with_allowed_imports(nbformat.from_dict(nb))
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
    """Build every ``solutions/*.ipynb`` into ``exercises/``; with ``check``, write nothing and return the stale
    ones."""
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
