"""The exercises in Chinese (issue 23): each exercise's statement, each hint and each exercise notebook's opening
have a Chinese version beside the English, in `solutions/` and so in the `exercises/` built from it.

What is checked, and what the words mean here:

- **Statement.** The markdown cell headed ``### Exercise N.M ★ title`` (one per ``# Exercise N.M:`` code cell). Its
  Chinese starts at the line beginning ``**练习 N.M ★ `` (the same number and stars as the heading) and runs to the
  end of the cell; everything before that line is the English, with no Chinese character in it.
- **Hint.** The cell right after the statement: two folded blocks, ``<details><summary>Hint 1: the idea</summary>
  … </details>`` then ``<details><summary>Hint 2: closer to the code</summary> … </details>`` (issue 24: the idea
  first, the code's shape second). Each block's Chinese starts at the line beginning ``**提示 1：**`` (``**提示
  2：**``), inside the block, after its English.
- **Challenge.** A chapter's open challenge (``### Challenge N ★★★ title``, its ``# Challenge N:`` cell two cells
  below) has a Chinese statement from the line beginning ``**挑战 N ★★★ `` and a hint like an exercise's.
- **Opening.** The cell with the English ``Run time:`` line has a ``**运行时间：**`` line after it with exactly the
  same numbers; the cell with the ``Points:`` line has a ``**分数：**`` line with the same numbers; the notebook has
  one ``**本章内容：**`` line, in its first three cells.
- In every one of these cells, each number of the Chinese (``numbers()`` of tests/chinese_helpers.py, link targets
  left out) is a number of the English of the same cell, so the Chinese can only restate it; the cell follows the
  glossary (``chinese_problems``: glossary forms, spacing, full-width punctuation), and the Chinese writes
  identifiers only inside backticks (maths, ``$...$``, is not prose and is left out of that check).
- Check-cell messages stay English.

The checkers are tested on deliberately wrong input, so they can fail.
"""

from __future__ import annotations

import re
import nbformat
import pytest

from tests.chinese_helpers import REPO, chinese_problems, has_chinese, mask_code, numbers

SOLUTIONS = sorted((REPO / "solutions").glob("*.ipynb"))
FOLDERS = ("solutions", "exercises")

HEADING = re.compile(r"^### (?:Exercise (\d+\.\d+)|Challenge (\d+)) (★{1,3}) ")
EXERCISE_CELL = re.compile(r"^# (?:Exercise (\d+\.\d+)|Challenge (\d+)):")
HINT_SUMMARIES = ("Hint 1: the idea", "Hint 2: closer to the code")
HINT_MARKS = ("**提示 1：**", "**提示 2：**")
_DETAILS = re.compile(r"<details><summary>(.*?)</summary>(.*?)</details>", re.S)
OPENING_ZH = "**本章内容：**"
RUN_TIME = (re.compile(r"(?:\*\*)?Run time:(?:\*\*)? *[^\n]*"), "**运行时间：**")
POINTS = (re.compile(r"^Points: *[^\n]*", re.M), "**分数：**")

_LINK_TARGET = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.S)
_BARE_IDENTIFIER = re.compile(r"\b[A-Za-z][A-Za-z0-9]*_[A-Za-z0-9_]+\b")


# ---- the checkers -----------------------------------------------------------------------------------------------


def _numbers_of(text: str) -> set[str]:
    return numbers(_LINK_TARGET.sub(r"\1", text))


def numbers_missing(chinese: str, english: str) -> list[str]:
    """The numbers of the Chinese that the English does not have (sorted); [] when all are there."""
    return sorted(_numbers_of(chinese) - _numbers_of(english))


def bare_identifiers(text: str) -> list[str]:
    """snake_case names written outside backticks (and outside maths)."""
    return _BARE_IDENTIFIER.findall(_MATH.sub(" ", mask_code(text)))


def split_at(source: str, marker: str) -> tuple[str, str]:
    """(English, Chinese) of a cell: the lines before the one line that starts with `marker`, and from it on.

    AssertionError when no line, or more than one, starts with `marker`.
    """
    lines = source.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith(marker)]
    assert len(at) == 1, f"expected one line starting {marker!r}, found {len(at)}"
    return "\n".join(lines[: at[0]]), "\n".join(lines[at[0]:])


def bilingual_problems(english: str, chinese: str, whole: str) -> list[str]:
    """What is wrong with a cell whose English and Chinese halves are given (`whole`: the cell, for the glossary)."""
    problems = []
    if has_chinese(english):
        problems.append("Chinese text before the Chinese version: the English comes first, the Chinese after it")
    if not has_chinese(chinese.split("：**", 1)[-1]):
        problems.append("the Chinese version has no Chinese text")
    missing = numbers_missing(chinese, english)
    if missing:
        problems.append(f"numbers of the Chinese not in the English beside it: {missing}")
    problems += chinese_problems(whole)
    bare = bare_identifiers(chinese)
    if bare:
        problems.append(f"put identifiers in backticks: {bare}")
    return problems


def statement_problems(source: str, number: str, stars: str) -> list[str]:
    """What is wrong with the Chinese of exercise `number`'s statement cell ("2.1"; "C2" for chapter 2's
    challenge); [] when it is fine."""
    mark = f"**挑战 {number[1:]} {stars} " if number.startswith("C") else f"**练习 {number} {stars} "
    try:
        english, chinese = split_at(source, mark)
    except AssertionError as e:
        return [f"no Chinese statement ({e})"]
    return bilingual_problems(english, chinese, source)


def hint_problems(source: str) -> list[str]:
    """What is wrong with a hint cell (two ``<details>…</details>`` blocks, each with its Chinese); [] when it is
    fine."""
    body = source.strip()
    if not body.endswith("</details>"):
        return ["the hint must end with </details>"]
    blocks = _DETAILS.findall(body)
    if _DETAILS.sub("", body).strip():
        return ["the hint's text, Chinese included, must be inside its <details> blocks"]
    summaries = tuple(summary for summary, _ in blocks)
    if summaries != HINT_SUMMARIES:
        return [f"a hint is two folded blocks, {HINT_SUMMARIES[0]!r} then {HINT_SUMMARIES[1]!r}; found {summaries}"]
    problems = []
    for (summary, text), mark in zip(blocks, HINT_MARKS):
        try:
            english, chinese = split_at(text, mark)
        except AssertionError as e:
            problems.append(f"{summary}: no Chinese hint inside its <details> block ({e})")
            continue
        # the summary is the block's English title: the Chinese mark restates its number
        problems += [f"{summary}: {p}" for p in bilingual_problems(f"{summary}\n{english}", chinese, text)]
    return problems


def opening_problems(cells: list[str]) -> list[str]:
    """What is wrong with the Chinese opening of an exercise notebook, given its markdown cells in order."""
    problems = []
    for pattern, mark in (RUN_TIME, POINTS):
        where = [s for s in cells if pattern.search(s)]
        if len(where) != 1:
            problems.append(f"expected one cell with {pattern.pattern!r}, found {len(where)}")
            continue
        source = where[0]
        english = pattern.search(source).group(0)
        zh = [line for line in source.splitlines() if line.startswith(mark)]
        if len(zh) != 1:
            problems.append(f"expected one line starting {mark!r} beside {english!r}, found {len(zh)}")
            continue
        if source.index(zh[0]) < source.index(english):
            problems.append(f"{mark!r} must come after the English {english!r}")
        if _numbers_of(zh[0]) != _numbers_of(english):
            problems.append(f"numbers differ:\n  {english}\n  {zh[0]}")
    first = [s for s in cells[:3] if any(line.startswith(OPENING_ZH) for line in s.splitlines())]
    if len(first) != 1:
        problems.append(f"expected one {OPENING_ZH!r} line in the first three markdown cells, found {len(first)}")
    # the opening cells only: a statement or a hint among the first three is checked as such (a two-step hint has
    # English after Chinese)
    for source in {s for s in cells[:3] if has_chinese(s) and not HEADING.match(s) and not s.startswith("<details>")}:
        lines = source.splitlines()
        zh_at = [i for i, line in enumerate(lines) if has_chinese(line)]
        english = "\n".join(lines[: zh_at[0]])
        chinese = "\n".join(lines[zh_at[0]:])
        missing = numbers_missing(chinese, english)
        if missing:
            problems.append(f"numbers of the Chinese opening not in the English: {missing}")
        problems += chinese_problems(source)
        if bare_identifiers(chinese):
            problems.append(f"put identifiers in backticks: {bare_identifiers(chinese)}")
    return problems


# ---- the notebooks ----------------------------------------------------------------------------------------------


def read(folder: str, name: str) -> list[nbformat.NotebookNode]:
    return nbformat.read(REPO / folder / name, as_version=4).cells


def exercises(cells) -> list[tuple[str, str, int, int]]:
    """(number, stars, statement cell index, hint cell index) of every exercise, from its ``# Exercise N.M:`` cell,
    and of the challenge (number ``"CN"``, from its ``# Challenge N:`` cell)."""
    found = []
    for i, cell in enumerate(cells):
        m = EXERCISE_CELL.match(cell.source.lstrip()) if cell.cell_type == "code" else None
        if m is None:
            continue
        number = m.group(1) or f"C{m.group(2)}"
        heading = HEADING.match(cells[i - 2].source)
        found_number = heading and (heading.group(1) or f"C{heading.group(2)}")
        what = f"Challenge {number[1:]}" if number.startswith("C") else f"Exercise {number}"
        assert found_number == number, f"{what}: expected its '### {what} ★ title' cell two cells above"
        found.append((number, heading.group(3), i - 2, i - 1))
    return found


CASES = [(folder, p.name) for folder in FOLDERS for p in SOLUTIONS]
IDS = [f"{folder}-{name[:2]}" for folder, name in CASES]


def test_every_solution_notebook_is_covered():
    assert [p.name for p in SOLUTIONS] == sorted(p.name for p in (REPO / "exercises").glob("*.ipynb"))
    total = sum(len(exercises(read("solutions", p.name))) for p in SOLUTIONS)
    assert total >= 28, f"only {total} exercises found in solutions/"


@pytest.mark.parametrize(("folder", "name"), CASES, ids=IDS)
def test_every_exercise_statement_has_a_chinese_version(folder, name):
    cells = read(folder, name)
    found = exercises(cells)
    assert found, f"{folder}/{name}: no exercise"
    problems = [f"Exercise {n} (cell {cells[s].id}): {p}" for n, stars, s, _ in found
                for p in statement_problems(cells[s].source, n, stars)]
    assert not problems, f"{folder}/{name}:\n" + "\n".join(problems)


@pytest.mark.parametrize(("folder", "name"), CASES, ids=IDS)
def test_every_hint_has_a_chinese_version(folder, name):
    cells = read(folder, name)
    problems = [f"hint of Exercise {n} (cell {cells[h].id}): {p}" for n, _, _, h in exercises(cells)
                for p in hint_problems(cells[h].source)]
    assert not problems, f"{folder}/{name}:\n" + "\n".join(problems)


@pytest.mark.parametrize(("folder", "name"), CASES, ids=IDS)
def test_every_exercise_notebook_opens_in_both_languages(folder, name):
    cells = [c.source for c in read(folder, name) if c.cell_type == "markdown"]
    problems = opening_problems(cells)
    assert not problems, f"{folder}/{name}:\n" + "\n".join(problems)


# ---- the checkers can fail --------------------------------------------------------------------------------------

GOOD_STATEMENT = (
    "### Exercise 2.1 ★ slot mapping\n\nReturn the slots of positions `start ... end-1`; with blocks of 4, position 5 "
    "is at offset 1.\n\n**练习 2.1 ★ 由块表得到 `slot_mapping`：** 返回位置 `start ... end-1` 的 slot；块大小为 4 "
    "时，位置 5 的偏移是 1。")
GOOD_HINT = ("<details><summary>Hint 1: the idea</summary>\n\nA position's block is its index in the block table.\n\n"
             "**提示 1：** 一个位置所在的块是它在块表里的下标。\n\n</details>\n"
             "<details><summary>Hint 2: closer to the code</summary>\n\nUse `pos // block_size`: positions 3, 4 are "
             "in block 0, 1.\n\n**提示 2：** 用 `pos // block_size`：位置 3、4 分别在块 0、1 里。\n\n</details>")
GOOD_OPENING = ("# 09 · Exercises\n\n* **9.1 ★★** a split\n\nRun time: about 20 s on a 2-core CPU.\n\n"
                "Points: 4 (★ = 1, ★★ = 2, ★★★ = 3)\n\n**本章内容：** **9.1 ★★** 一种切分。\n\n"
                "**运行时间：** 在 2 核 CPU 上约 20 秒。\n\n**分数：** 4（★ = 1，★★ = 2，★★★ = 3）")


def test_statement_checker_can_fail():
    assert statement_problems(GOOD_STATEMENT, "2.1", "★") == []
    english_only = GOOD_STATEMENT.split("\n\n**练习")[0]
    assert any("no Chinese statement" in p for p in statement_problems(english_only, "2.1", "★"))
    # the wrong stars or number are no Chinese statement of this exercise
    assert any("no Chinese statement" in p for p in statement_problems(GOOD_STATEMENT, "2.1", "★★"))
    assert any("no Chinese statement" in p for p in statement_problems(GOOD_STATEMENT, "2.2", "★"))
    wrong_number = GOOD_STATEMENT.replace("位置 5 的偏移是 1", "位置 6 的偏移是 2")
    assert statement_problems(wrong_number, "2.1", "★") == [
        "numbers of the Chinese not in the English beside it: ['2', '6']"]
    assert any("'分页注意力' is not" in p for p in
               statement_problems(GOOD_STATEMENT + "用分页注意力。", "2.1", "★"))
    assert any("no space" in p for p in statement_problems(GOOD_STATEMENT + "有4个块。", "2.1", "★"))
    assert any("backticks" in p for p in
               statement_problems(GOOD_STATEMENT + "调用 block_size 之后。", "2.1", "★"))
    # maths is not prose: $o_b$ is no bare identifier
    assert statement_problems(GOOD_STATEMENT + "设 $o_b$ 为输出。", "2.1", "★") == []
    chinese_first = GOOD_STATEMENT.replace("Return the slots", "返回 the slots")
    assert any("before the Chinese version" in p for p in statement_problems(chinese_first, "2.1", "★"))


def test_hint_checker_can_fail():
    assert hint_problems(GOOD_HINT) == []
    first, second = GOOD_HINT.split("</details>\n", 1)
    assert any("two folded blocks" in p for p in hint_problems(second))  # one step only
    one_block = ("<details><summary>Hint</summary>\n\nUse `pos // block_size`.\n\n**提示：** 用 `pos // block_size`。"
                 "\n\n</details>")
    assert any("two folded blocks" in p for p in hint_problems(one_block))  # the old single hint
    no_chinese = GOOD_HINT.replace("\n\n**提示 2：** 用 `pos // block_size`：位置 3、4 分别在块 0、1 里。", "")
    assert any("Hint 2: closer to the code: no Chinese hint" in p for p in hint_problems(no_chinese))
    outside = GOOD_HINT + "\n\n**提示：** 用 `pos // block_size`。"
    assert hint_problems(outside) == ["the hint must end with </details>"]
    between = first + "</details>\n**提示 1：** 块。\n" + second
    assert hint_problems(between) == ["the hint's text, Chinese included, must be inside its <details> blocks"]
    assert hint_problems(GOOD_HINT.replace("块 0、1", "块 0、7")) == [
        "Hint 2: closer to the code: numbers of the Chinese not in the English beside it: ['7']"]


def test_opening_checker_can_fail():
    cells = [GOOD_OPENING, "### Exercise 9.1 ★★ x"]
    assert opening_problems(cells) == []
    assert any("numbers differ" in p for p in opening_problems([GOOD_OPENING.replace("约 20 秒", "约 30 秒"), cells[1]]))
    assert any("'**分数：**'" in p for p in
               opening_problems([GOOD_OPENING.replace("\n\n**分数：** 4（★ = 1，★★ = 2，★★★ = 3）", ""), cells[1]]))
    assert any("'**本章内容：**'" in p for p in
               opening_problems([GOOD_OPENING.replace("**本章内容：** **9.1 ★★** 一种切分。\n\n", ""), cells[1]]))
    assert any("not in the English" in p for p in
               opening_problems([GOOD_OPENING.replace("一种切分", "一种 8 路切分"), cells[1]]))


def test_exercises_finder_needs_a_heading_two_cells_above():
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    cells = [md("### Exercise 1.1 ★ x"), md("<details><summary>Hint</summary>\n\nh\n\n</details>"),
             code("# Exercise 1.1: x\n"), code("# Check Exercise 1.1\n"),
             md("### Challenge 1 ★★★ y"), md("hint"), code("# Challenge 1: y\n"), code("# Check Challenge 1\n")]
    assert exercises(cells) == [("1.1", "★", 0, 1), ("C1", "★★★", 4, 5)]
    with pytest.raises(AssertionError, match="two cells above"):
        exercises([md("no heading"), *cells[1:]])


def test_the_exercise_notebooks_are_the_solutions_markdown():
    """exercises/ is built from solutions/ (tests/course/test_exercises.py checks the whole build): the Chinese is there too.
    The build adds one markdown cell, on what an answer may import (its Chinese is checked with the opening's)."""
    from minillm.course.exercises.build import ALLOWED_IMPORTS_CELL_ID

    for path in SOLUTIONS:
        solved = [c.source for c in read("solutions", path.name) if c.cell_type == "markdown"]
        built = [c.source for c in read("exercises", path.name)
                 if c.cell_type == "markdown" and c.get("id") != ALLOWED_IMPORTS_CELL_ID]
        assert solved == built, f"exercises/{path.name}: markdown differs from solutions/; rebuild exercises/"
