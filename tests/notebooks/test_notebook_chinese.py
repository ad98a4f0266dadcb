"""The notebooks' Chinese layer (issue 17): 直接回答 blocks for Q1–Q8, bilingual chapter openings, the questions in 00.

What is checked, and what the words mean here:

- **Question section.** A notebook answers question QN under a markdown heading whose text is exactly
  ``Learner question QN`` (JupyterLab gives it the anchor ``#Learner-question-QN``). The section runs from that
  heading line to the next heading line of any level, across markdown cells; code cells in between are skipped.
- **直接回答 block.** A markdown cell whose source starts with the line ``**直接回答**``. Every question has one in
  each notebook that answers it (``ANSWERED_IN``; the first notebook listed is the main answer). The block is the cell
  right after the heading cell, whose lines after the heading are only the quoted question (the Chinese original,
  verbatim, and the English translation); the cell right after the block is English markdown. So the answer begins
  with the block, then the English follows. The block is two or three sentences, follows the glossary
  (`tests/chinese_helpers.py`: ``chinese_problems``: glossary forms, spacing, full-width punctuation) and writes
  identifiers only inside backticks.
- **"The English next to it".** The rest of the question's section without the block, keeping only the lines that
  contain no Chinese character (so the quoted Chinese original does not count). Every number written in the block
  (``numbers()`` of chinese_helpers: "2 048" and "2048" are one number; link targets are left out, so a link to
  ``05_sampler.ipynb`` does not contribute "05") must appear among the numbers of that English. The English numbers
  are held to the measurements by the asserts in the notebooks' cells; the block can then only restate them.
- **Chapter openings.** The cell of 00–07, solutions/08, 09 and 10 that holds ``**You will build:**``,
  ``**You will be able to answer:**`` and ``**Run time:**`` has, after them, ``**本章内容：**``, ``**能回答的问题：**``
  and ``**运行时间：**``, each with exactly the set of numbers of its English line, and following the glossary.
- **Notebook 00** has a table ``# | English | 原文 | answered in`` with the 8 questions: the translation and the
  Chinese original verbatim (``QUESTIONS``, the learners' own words), and links to every
  notebook of ``ANSWERED_IN``, main answer first.
- **Links between notebooks** point at the cell of the ``Learner question QN`` heading by its cell id,
  ``05_sampler.ipynb#cell-id=...``. JupyterLab 4 also resolves a heading anchor (``#Learner-question-Q5``, the heading
  text with spaces turned into '-', ``header_id``), but only once the target's markdown is rendered: clicked in 00,
  such a link opens a notebook that is not open yet at its top (checked in JupyterLab 4.6.6 with Chromium). A
  ``cell-id`` fragment is found in the notebook's model and scrolls on the first click too. The test checks that each
  id is the heading cell of that question, so a rebuilt cell that loses its id fails here, not silently in the lab.

The checkers are tested on deliberately wrong input, so they can fail.
"""

from __future__ import annotations

import re

import nbformat
import pytest

from tests.chinese_helpers import REPO, chinese_problems, has_chinese, mask_code, numbers, table_rows

NOTEBOOKS = {
    "00": REPO / "notebooks" / "00_welcome.ipynb",
    "01": REPO / "notebooks" / "01_attention_and_chunks.ipynb",
    "02": REPO / "notebooks" / "02_paged_kv_cache.ipynb",
    "03": REPO / "notebooks" / "03_triton_prefill_kernel.ipynb",
    "04": REPO / "notebooks" / "04_scheduler.ipynb",
    "05": REPO / "notebooks" / "05_sampler.ipynb",
    "06": REPO / "notebooks" / "06_engine.ipynb",
    "07": REPO / "notebooks" / "07_context_parallel.ipynb",
    "08": REPO / "solutions" / "08_capstone.ipynb",
    "09": REPO / "notebooks" / "09_disaggregation_and_tp.ipynb",
    "10": REPO / "notebooks" / "10_engine_core.ipynb",
}

# The learner questions, verbatim as the learners asked them: (English translation, original).
QUESTIONS: dict[str, tuple[str, str]] = {
    "Q1": ("A long prompt is cut into chunks, say 4. During prefill, can these 4 chunks be prefilled at the same "
           "time, or do they depend on each other?",
           "一个长输入的请求，切chunk ，比如切了4份，prefill的时候，这四个可以同时做prefill 吗 ，还是有依赖关系的"),
    "Q2": ("The earlier chunks should only need to compute their KV cache, and the KV cache can be computed "
           "independently; only the last chunk depends on the KV produced by the earlier chunks — right?",
           "前面的chunk 应该只需要计算kvcache就行了吧，计算kvcache应该可以独立计算，只有最后一个chunk 依赖前面chunk生成的kvcache"),
    "Q3": ("Isn't it only the last chunk that needs attention? The earlier chunks shouldn't need attention at all?",
           "不是只需要最后一个chunk 做attention计算吗，前面的chunk 应该不需要做attention计算吧"),
    "Q4": ("Why do all chunks need attention?", "为什么所有chunk都需要做attention计算"),
    "Q5": ("What parameter is max_completion_tokens?", "max_completion_tokens 这个是什么参数"),
    "Q6": ("Why does total_num_scheduled_tokens count requests from the waiting queue, when execution only runs the "
           "requests in the running queue?",
           "为什么计算 total_num_scheduled_tokens 的时候，把waiting队列里的也统计进去了，执行的时候，不是只执行running队列里的请求吗"),
    "Q7": ("So the running and waiting queues have no priority? Isn't it first waiting → running, then schedule from "
           "the running queue?",
           "所以running队列和waiting队列没有优先级？不是先从waiting到running，然后再从running队列里调度吗？"),
    "Q8": ("What is the shape of sampled_token_ids?", "sampled_token_ids 的shape信息是什么样的？"),
}

# Where each question is answered, main answer first. The questions were posed with 01/07 for Q1 and 05/06 for Q5;
# 02 and 03 answer Q2 and Q3 a second way; 09 answers Q1-Q4 beyond one engine (disaggregation, tensor parallelism);
# 10 answers Q6 again under async scheduling (what step N+1 counts while step N runs: output placeholders).
ANSWERED_IN: dict[str, list[str]] = {
    "Q1": ["01", "07", "09"], "Q2": ["01", "02", "09"], "Q3": ["01", "03", "09"], "Q4": ["01", "09"],
    "Q5": ["05", "06"], "Q6": ["04", "10"], "Q7": ["04"], "Q8": ["05"],
}

BLOCK_HEAD = "**直接回答**"
OPENING = [("**You will build:**", "**本章内容：**"), ("**You will be able to answer:**", "**能回答的问题：**"),
           ("**Run time:**", "**运行时间：**")]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_HEADING = re.compile(r"^(#{1,6}) +(.+?) *#*$")
_LINK_TARGET = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_SENTENCE_END = re.compile(r"[。？！]")
_BARE_IDENTIFIER = re.compile(r"\b[A-Za-z][A-Za-z0-9]*_[A-Za-z0-9_]+\b")


# ---- helpers -------------------------------------------------------------------------------------------------


def read(nb: str) -> list[nbformat.NotebookNode]:
    return nbformat.read(NOTEBOOKS[nb], as_version=4).cells


def heading_lines(markdown: str) -> list[tuple[int, int, str]]:
    """(line number, level, text) of every heading of a markdown cell, fenced code left out."""
    out = []
    in_fence = False
    for n, line in enumerate(markdown.splitlines()):
        if line.startswith(("```", "~~~")):
            in_fence = not in_fence
        m = None if in_fence else _HEADING.match(line)
        if m:
            out.append((n, len(m.group(1)), m.group(2)))
    return out


def header_id(heading: str) -> str:
    """The id JupyterLab 4 gives a rendered markdown heading: its text content with each space turned into '-'.

    (``createHeaderId`` in @jupyterlab/rendermime: ``(header.textContent ?? '').replace(/ /g, '-')``; a link
    ``notebook.ipynb#id`` scrolls to it.) Markdown markup is dropped as the renderer would: code backticks,
    emphasis, link targets.
    """
    text = _LINK_TARGET.sub(r"\1", heading)
    text = text.replace("`", "").replace("**", "").replace("*", "").replace("__", "")
    return text.strip().replace(" ", "-")


def is_block(cell) -> bool:
    return cell.cell_type == "markdown" and cell.source.splitlines()[:1] == [BLOCK_HEAD]


def question_section(cells, q: str) -> tuple[int, list[int], str]:
    """(index of the heading cell, indices of the markdown cells after it in the section, the section's text).

    The section's text starts after the heading line and stops at the next heading line (any level).
    """
    found = [(i, n) for i, c in enumerate(cells) if c.cell_type == "markdown"
             for n, _, text in heading_lines(c.source) if text == f"Learner question {q}"]
    assert len(found) == 1, f"expected one heading 'Learner question {q}', found {len(found)}"
    start, line_no = found[0]
    parts = ["\n".join(cells[start].source.splitlines()[line_no + 1:])]
    members = []
    first = heading_lines(parts[0])
    if first:  # the section ends inside the heading cell itself
        return start, members, "\n".join(parts[0].splitlines()[: first[0][0]])
    for i in range(start + 1, len(cells)):
        c = cells[i]
        if c.cell_type != "markdown":
            continue
        heads = heading_lines(c.source)
        if heads and heads[0][0] == 0:
            break
        members.append(i)
        if heads:
            parts.append("\n".join(c.source.splitlines()[: heads[0][0]]))
            break
        parts.append(c.source)
    return start, members, "\n\n".join(parts)


def english_lines(text: str) -> str:
    """The lines of `text` without a Chinese character."""
    return "\n".join(line for line in text.splitlines() if not has_chinese(line))


def _numbers_of(text: str) -> set[str]:
    return numbers(_LINK_TARGET.sub(r"\1", text))


def numbers_missing(chinese: str, english: str) -> list[str]:
    """The numbers written in the Chinese text that the English text does not have (sorted); [] when all are there."""
    return sorted(_numbers_of(chinese.replace(BLOCK_HEAD, "")) - _numbers_of(english))


def english_next_to(cells, q: str, block_index: int) -> str:
    """The English next to the 直接回答 block of question `q`: its section minus the block, Chinese lines left out."""
    start, members, _ = question_section(cells, q)
    # the heading cell's lines after the heading (the English translation of the question) ...
    head_lines = cells[start].source.splitlines()
    n = next(n for n, _, t in heading_lines(cells[start].source) if t == f"Learner question {q}")
    text = english_lines("\n".join(head_lines[n + 1:]))
    # ... and every other markdown cell of the section, up to the next heading
    for i in members:
        if i == block_index:
            continue
        src = cells[i].source
        heads = heading_lines(src)
        if heads:
            src = "\n".join(src.splitlines()[: heads[0][0]])
        text += "\n\n" + english_lines(src)
    return text


def direct_answer(nb: str, q: str) -> tuple[list, int]:
    """The cells of notebook `nb` and the index of the 直接回答 block that answers `q` there (structure checked)."""
    cells = read(nb)
    start, members, _ = question_section(cells, q)
    head = cells[start].source.splitlines()
    n = next(n for n, _, t in heading_lines(cells[start].source) if t == f"Learner question {q}")
    after = [line for line in head[n + 1:] if line.strip()]
    assert after and all(line.startswith(">") for line in after), (
        f"{nb} {q}: after the heading the cell must hold only the quoted question, then the 直接回答 cell follows")
    assert start + 1 < len(cells) and is_block(cells[start + 1]), (
        f"{nb} {q}: the cell right after the question must be the 直接回答 block (a markdown cell starting with "
        f"{BLOCK_HEAD!r})")
    block = start + 1
    assert block in members, f"{nb} {q}: the 直接回答 block is not inside the question's section"
    nxt = cells[block + 1] if block + 1 < len(cells) else None
    assert nxt is not None and nxt.cell_type == "markdown" and not has_chinese(nxt.source), (
        f"{nb} {q}: the English answer must follow the 直接回答 block, in the next markdown cell")
    return cells, block


def sentences(text: str) -> int:
    return len(_SENTENCE_END.findall(mask_code(text)))


def bare_identifiers(text: str) -> list[str]:
    """snake_case names written outside backticks (identifiers stay in English, and in code spans)."""
    return _BARE_IDENTIFIER.findall(mask_code(text, placeholder="CODE"))


# ---- the checkers can fail -----------------------------------------------------------------------------------


def test_numbers_missing_catches_a_wrong_pair():
    english = "Run alone, chunks 1–3 get K errors of about 5 % to 35 % and V errors of about 10 % to 65 % (2.2)."
    right = "**直接回答**\n\n实测把 chunk 单独跑（2.2），chunk 1–3 的 K 误差约 5 % 到 35 %，V 误差约 10 % 到 65 %。"
    assert numbers_missing(right, english) == []
    wrong = right.replace("35 %", "36 %").replace("（2.2）", "（2.3）")
    assert numbers_missing(wrong, english) == ["2.3", "36"]
    # a link target is not a number of the text; a thousands separator is
    assert numbers_missing("见第 5 章的[直接回答](05_sampler.ipynb#Learner-question-Q5)。", "chapter 5") == []
    assert numbers_missing("上限 2 048 个 token。", "max_model_len=2048") == []


def test_section_and_english_next_to_it_on_a_small_notebook():
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    cells = [
        md("## 3. Questions\n\n### Learner question Q9\n\n> 原文 4 份\n>\n> *English, say 4.*"),
        md("**直接回答**\n\n有依赖，4 个 chunk 各差约 5 %。第 7 章另有做法。"),
        md("They depend: about 5 % (section 2)."),
        code("x = 7"),
        md("More English, chapter 7.\n\n### Next section\n\nNumber 99 here is outside."),
        md("**直接回答**\n\n99"),
    ]
    start, members, text = question_section(cells, "Q9")
    assert start == 0 and members == [1, 2, 4] and "99" not in text
    english = english_next_to(cells, "Q9", 1)
    assert "原文" not in english and "say 4" in english and "chapter 7" in english
    assert numbers_missing(cells[1].source, english) == []
    # The same block against an English answer that lost a number: the check fails.
    cells[4] = md("More English.\n\n### Next section\n\nchapter 7 is outside the section.")
    assert numbers_missing(cells[1].source, english_next_to(cells, "Q9", 1)) == ["7"]


def test_header_id_is_jupyterlabs():
    assert header_id("Learner question Q1") == "Learner-question-Q1"
    assert header_id("3. Q8: the shape of `sampled_token_ids`") == "3.-Q8:-the-shape-of-sampled_token_ids"
    assert header_id("The learner questions · 学员问题") == "The-learner-questions-·-学员问题"


def test_structure_and_style_checks_can_fail():
    assert sentences("**直接回答**\n\n不是。`a.b()` 之后。第三句？") == 3
    assert bare_identifiers("调用 `num_computed_tokens` 之后") == []
    assert bare_identifiers("调用 num_computed_tokens 之后") == ["num_computed_tokens"]
    assert is_block(nbformat.v4.new_markdown_cell("**直接回答**\n\n是。"))
    assert not is_block(nbformat.v4.new_markdown_cell("直接回答：是。"))


# ---- the 直接回答 blocks --------------------------------------------------------------------------------------


PLACES = [(q, nb) for q, nbs in ANSWERED_IN.items() for nb in nbs]


@pytest.mark.parametrize(("q", "nb"), PLACES, ids=[f"{q}-ch{nb}" for q, nb in PLACES])
def test_direct_answer_begins_the_answer(q, nb):
    cells, block = direct_answer(nb, q)
    text = cells[block].source
    assert has_chinese(text.replace(BLOCK_HEAD, "")), f"{nb} {q}: the 直接回答 block has no Chinese text"
    n = sentences(text)
    assert 2 <= n <= 3, f"{nb} {q}: the 直接回答 block should be two or three sentences, has {n}"


@pytest.mark.parametrize(("q", "nb"), PLACES, ids=[f"{q}-ch{nb}" for q, nb in PLACES])
def test_every_number_of_the_direct_answer_is_in_the_english_next_to_it(q, nb):
    cells, block = direct_answer(nb, q)
    missing = numbers_missing(cells[block].source, english_next_to(cells, q, block))
    assert not missing, (f"{nb} {q}: numbers of the 直接回答 block not in the English of its section: {missing} "
                         "(say them in the English too, with an assert in a cell, or drop them)")


@pytest.mark.parametrize(("q", "nb"), PLACES, ids=[f"{q}-ch{nb}" for q, nb in PLACES])
def test_direct_answer_follows_the_glossary_and_keeps_identifiers_in_code(q, nb):
    cells, block = direct_answer(nb, q)
    text = cells[block].source
    problems = chinese_problems(text)
    assert not problems, f"{nb} {q}:\n" + "\n".join(problems)
    assert not bare_identifiers(text), f"{nb} {q}: put identifiers in backticks: {bare_identifiers(text)}"


@pytest.mark.parametrize(("q", "nb"), PLACES, ids=[f"{q}-ch{nb}" for q, nb in PLACES])
def test_question_section_quotes_the_original_verbatim(q, nb):
    cells = read(nb)
    start, _, _ = question_section(cells, q)
    assert QUESTIONS[q][1] in cells[start].source, f"{nb} {q}: the section must quote the original verbatim"


def test_every_question_has_a_direct_answer():
    assert sorted(ANSWERED_IN) == sorted(QUESTIONS) == [f"Q{i}" for i in range(1, 9)]
    blocks = {q: sum(is_block(c) for nb in nbs for c in read(nb)) for q, nbs in ANSWERED_IN.items()}
    assert all(n >= 1 for n in blocks.values()), blocks
    # and no 直接回答 block outside a question's section
    placed = {(nb, direct_answer(nb, q)[1]) for q, nb in PLACES}
    stray = [(nb, i) for nb in NOTEBOOKS for i, c in enumerate(read(nb)) if is_block(c) and (nb, i) not in placed]
    assert not stray, f"直接回答 blocks outside a 'Learner question QN' section: {stray}"


# ---- chapter openings -----------------------------------------------------------------------------------------


def opening_pairs(source: str) -> list[tuple[str, str]]:
    """(English line, Chinese line) for build / answer / run time; AssertionError if a Chinese line is missing."""
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    pairs = []
    for en_mark, zh_mark in OPENING:
        en = [line for line in lines if line.startswith(en_mark)]
        zh = [line for line in lines if line.startswith(zh_mark)]
        assert len(en) == 1, f"expected one line starting {en_mark!r}"
        assert len(zh) == 1, f"expected one Chinese line starting {zh_mark!r} (after {en_mark!r})"
        assert lines.index(zh[0]) > lines.index(en[0]), f"{zh_mark!r} must come after the English line"
        pairs.append((en[0], zh[0]))
    last_en = max(lines.index(en) for en, _ in pairs)
    assert min(lines.index(zh) for _, zh in pairs) > last_en, "the Chinese lines follow the three English lines"
    return pairs


def test_opening_checker_can_fail():
    good = "**You will build:** a loop over 4 chunks.\n\n**You will be able to answer:** Q1.\n\n" \
           "**Run time:** about 1 min on a 2-core CPU.\n\n**本章内容：** 一个处理 4 个 chunk 的循环。\n\n" \
           "**能回答的问题：** Q1。\n\n**运行时间：** 在 2 核 CPU 上约 1 分钟。"
    assert all(numbers(en) == numbers(zh) for en, zh in opening_pairs(good))
    wrong = good.replace("约 1 分钟", "约 2 分钟")
    assert [numbers(en) == numbers(zh) for en, zh in opening_pairs(wrong)] == [True, True, False]
    with pytest.raises(AssertionError, match="本章内容"):
        opening_pairs(good.replace("**本章内容：** 一个处理 4 个 chunk 的循环。", ""))


@pytest.mark.parametrize("nb", sorted(NOTEBOOKS))
def test_chapter_opening_in_both_languages(nb):
    cells = [c for c in read(nb) if c.cell_type == "markdown" and "**You will build:**" in c.source]
    assert len(cells) == 1, f"{nb}: expected one cell with the chapter's '**You will build:**' opening"
    for en, zh in opening_pairs(cells[0].source):
        assert numbers(en) == numbers(zh), f"{nb}: numbers differ:\n  {en}\n  {zh}"
        problems = chinese_problems(zh)
        assert not problems, f"{nb}: {zh}\n" + "\n".join(problems)
        assert not bare_identifiers(zh), f"{nb}: put identifiers in backticks: {bare_identifiers(zh)}"


# ---- notebook 00: the questions with their originals ------------------------------------------------------------


def welcome_question_table() -> list[list[str]]:
    cells = [c for c in read("00") if c.cell_type == "markdown"]
    tables = [t for c in cells for t in table_rows(c.source) if t and t[0] == ["#", "English", "原文", "answered in"]]
    assert len(tables) == 1, "notebook 00 needs one table '# | English | 原文 | answered in'"
    return tables[0][1:]


def test_welcome_lists_the_questions_with_the_originals_verbatim():
    rows = welcome_question_table()
    assert [r[0] for r in rows] == list(QUESTIONS)
    for (q, english, original, _), (en_want, zh_want) in zip(rows, QUESTIONS.values()):
        assert original == zh_want, f"{q}: the original must be verbatim:\n  {original}\n  {zh_want}"
        assert english == en_want, f"{q}: the English must be the course brief's translation:\n  {english}"


_NB_LINK = re.compile(r"\[([^\]]+)\]\(((\d\d)_[A-Za-z0-9_]+\.ipynb)(?:#([^)]*))?\)")


def link_problem(path: str, fragment: str | None, q: str) -> str | None:
    """Why a link ``path#fragment`` from one notebook to another is not a link to question `q`'s section, or None."""
    target = next((p for p in NOTEBOOKS.values() if p.name == path and p.parent.name == "notebooks"), None)
    if target is None:
        return f"{path}: no such lesson notebook"
    if not fragment or not fragment.startswith("cell-id="):
        return f"{path}#{fragment}: link to the heading's cell, '#cell-id=<id>' (a heading anchor fails on first open)"
    cell_id = fragment[len("cell-id="):]
    cells = nbformat.read(target, as_version=4).cells
    cell = next((c for c in cells if c.get("id") == cell_id), None)
    if cell is None:
        return f"{path}#{fragment}: no cell with that id"
    if cell.cell_type != "markdown" or f"Learner question {q}" not in [t for _, _, t in heading_lines(cell.source)]:
        return f"{path}#{fragment}: that cell is not the one headed 'Learner question {q}'"
    if header_id(f"Learner question {q}") not in {header_id(t) for _, _, t in heading_lines(cell.source)}:
        return f"{path}: the heading of {q} has no JupyterLab anchor"
    return None


def test_link_checker_can_fail():
    cells = read("05")
    q5 = next(c for c in cells if c.cell_type == "markdown" and "### Learner question Q5" in c.source)
    assert link_problem("05_sampler.ipynb", f"cell-id={q5.id}", "Q5") is None
    assert "not the one headed" in link_problem("05_sampler.ipynb", f"cell-id={q5.id}", "Q8")
    assert "no cell with that id" in link_problem("05_sampler.ipynb", "cell-id=0000", "Q5")
    assert "first open" in link_problem("05_sampler.ipynb", "Learner-question-Q5", "Q5")
    assert "no such lesson" in link_problem("09_nothing.ipynb", f"cell-id={q5.id}", "Q5")


def test_welcome_links_each_question_to_the_sections_that_answer_it():
    for q, _, _, where in welcome_question_table():
        links = _NB_LINK.findall(where)
        chapters = [ch for _, _, ch, _ in links]
        assert chapters == ANSWERED_IN[q], f"{q}: links to {chapters}, expected {ANSWERED_IN[q]} (main answer first)"
        for text, path, ch, fragment in links:
            assert text == f"{ch} §Learner question {q}", f"{q}: link text {text!r}"
            problem = link_problem(path, fragment, q)
            assert problem is None, f"{q}: {problem}"


@pytest.mark.parametrize(("q", "nb"), PLACES, ids=[f"{q}-ch{nb}" for q, nb in PLACES])
def test_links_in_direct_answers_reach_a_question_section(q, nb):
    cells, block = direct_answer(nb, q)
    for _, path, _, fragment in _NB_LINK.findall(cells[block].source):
        problem = link_problem(path, fragment, q)
        assert problem is None, f"{nb} {q}: {problem}"


def test_welcome_chinese_introduction_follows_the_glossary():
    cells = [c.source for c in read("00") if c.cell_type == "markdown" and "学员问题" in c.source]
    assert len(cells) == 1
    chinese = [p for p in cells[0].split("\n\n") if has_chinese(p) and not p.startswith(("|", "#"))]
    assert chinese, "notebook 00 introduces the questions in Chinese too"
    for p in chinese:
        assert chinese_problems(p) == [], chinese_problems(p)
