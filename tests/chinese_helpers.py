"""Checks for the course's Chinese text: the glossary, its variants, spacing and punctuation, README parity.

`docs/glossary.md` gives one preferred Chinese form per term and the community's common variants it accepts too
(its third column); `VARIANTS` below lists the forms not to use. The functions here read both and check a piece of
Chinese text against them, so the same checks serve `README.zh-CN.md` (tests/repo/test_chinese.py) and the notebooks' Chinese blocks:

    from tests.chinese_helpers import chinese_problems
    assert chinese_problems(text) == []

`chinese_problems` is `glossary_violations` (a form not to use, from VARIANTS) + `spacing_violations`
(Chinese touching English or digits without a space) + `punctuation_violations` (half-width punctuation in a
Chinese sentence). Each returns a list of readable messages, empty when the text is fine. Code (fenced blocks and
inline code), URLs and HTML tags are masked first, so identifiers and commands are never checked.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GLOSSARY = REPO / "docs" / "glossary.md"

# Forms not to use, keyed by the glossary's English term: mistranslations, and words that clash with another concept
# of the course. They are not the community's common variants: those are the glossary's third column (accepted,
# `GlossaryTerm.aliases`), and a form may not be both (tests/repo/test_chinese.py checks). A variant is allowed only
# inside an occurrence of a glossary form or alias that contains it ("块预填充" inside "分块预填充"). Spacing
# variants ("PD分离", "KV缓存") are left to spacing_violations.
VARIANTS: dict[str, list[str]] = {
    "token": ["令牌"],
    "tokenizer": ["分词工具", "标记器", "切词器"],
    "prompt": ["提示符"],  # the shell's prompt
    "weights": ["权值"],
    # 前向传播 is training's word, paired with 反向传播 (backpropagation); inference runs forward only.
    "forward pass": ["前向传播", "正向传播"],
    "hidden states": ["隐层状态"],
    "logits": ["对数几率", "逻辑值"],
    "KV cache": ["kv 缓存"],
    "check cell": ["检查格", "校验单元格"],
    "causal mask": ["因果遮罩", "因果掩膜", "因果屏蔽"],
    "residual stream": ["残差流动", "残差连接流"],
    "chunked prefill": ["分段预填充", "块预填充", "切块预填充", "分片预填充", "分块预填"],
    "log-sum-exp": ["对数求和指数"],
    "flat batch": ["扁平批", "展平批次", "扁平 batch"],
    "paged KV cache": ["分页式 KV cache", "页式 KV cache"],
    "PagedAttention": ["分页注意力", "页注意力"],  # a name, kept in English like FlashAttention
    "block": ["区块"],
    "block size": ["块尺寸"],
    "block table": ["块映射表", "分块表", "块表格"],
    "block pool": ["块缓存池"],
    "free block queue": ["空闲队列块", "自由块队列"],
    "prefix caching": ["前缀缓冲", "前缀高速缓存", "前缀 cache"],
    "block hash": ["块散列"],
    "cache hit": ["缓存击中"],
    "reference count": ["引用次数"],
    "kernel (GPU)": ["内核函数"],  # 内核 is the Jupyter kernel
    "Triton interpreter": ["Triton 解析器"],
    "tile": ["query 块"],  # 块 is a KV cache block
    "scheduler": ["调度程序", "排程器"],
    "running queue": ["执行队列"],
    "token budget": ["令牌预算", "token 配额"],
    "continuous batching": ["持续批处理", "连续批量", "连续批次处理", "连续组批"],
    "preemption": ["剥夺", "抢夺", "强占"],
    "FCFS": ["先进先出"],  # FIFO, a queue's order, not the policy's name
    "priority scheduling": ["优先权调度"],
    "TTFT": ["首词延迟"],
    "sampler": ["取样器", "抽样器"],
    "sampling": ["取样", "抽样"],
    "sampling pipeline": ["采样流水线"],  # 流水线 is pipelining (流水线并行)
    "exponential race": ["指数竞赛"],  # a race (竞速), not a contest
    "temperature": ["温度系数"],
    "placeholder token": ["占位符"],
    "stop condition": ["终止条件", "停止准则"],
    "stop string": ["终止字符串", "停止词"],
    "detokenizer": ["反分词器", "解分词器", "去分词器"],
    "speculative decoding": ["猜测解码"],
    "draft token": ["草稿令牌"],
    "bonus token": ["奖励 token"],
    "rejection sampling": ["拒绝抽样", "拒斥采样"],
    "model runner": ["模型运行器", "模型执行器"],
    "OpenAI-compatible server": ["OpenAI 兼容服务端", "OpenAI 兼容的服务器"],
    "roofline": ["屋顶线", "屋顶模型"],
    "tensor parallelism": ["张量平行", "张量并行化"],
    "context parallelism": ["语境并行", "上下文并行化"],
    "zigzag split": ["之字形切分", "锯齿切分", "Z 字形切分", "zigzag 划分"],
    "rank": ["秩"],
    "all-gather": ["全收集", "全聚合"],
    "capstone": ["毕业项目", "顶点项目", "结业项目"],
}

# The learners' questions Q1-Q8 in their own words (notebook 00's table, each notebook's "Learner question" cell).
# They are quoted verbatim, with the asker's spacing and punctuation, so the checks below skip them.
LEARNER_ORIGINALS: dict[str, str] = {
    "Q1": "一个长输入的请求，切chunk ，比如切了4份，prefill的时候，这四个可以同时做prefill 吗 ，还是有依赖关系的",
    "Q2": "前面的chunk 应该只需要计算kvcache就行了吧，计算kvcache应该可以独立计算，只有最后一个chunk 依赖前面chunk生成的kvcache",
    "Q3": "不是只需要最后一个chunk 做attention计算吗，前面的chunk 应该不需要做attention计算吧",
    "Q4": "为什么所有chunk都需要做attention计算",
    "Q5": "max_completion_tokens 这个是什么参数",
    "Q6": "为什么计算 total_num_scheduled_tokens 的时候，把waiting队列里的也统计进去了，执行的时候，不是只执行running队列里的请求吗",
    "Q7": "所以running队列和waiting队列没有优先级？不是先从waiting到running，然后再从running队列里调度吗？",
    "Q8": "sampled_token_ids 的shape信息是什么样的？",
}

CJK = "\u3400-\u4dbf\u4e00-\u9fff"
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]+`")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_URL = re.compile(r"https?://\S+")
_TAG = re.compile(r"<[^>\n]+>")


def _verbatim_pattern(original: str) -> re.Pattern[str]:
    """`original`, allowed to wrap over lines (of a markdown quote) between any two characters."""
    wrap = r"(?:[ \t]*\n[ \t>]*)?"
    parts = [r"\s+" if ch == " " else re.escape(ch) for ch in original]
    return re.compile(wrap.join(parts))


_ORIGINAL_PATTERNS = [_verbatim_pattern(q) for q in LEARNER_ORIGINALS.values()]


@dataclass(frozen=True)
class GlossaryTerm:
    """One row of docs/glossary.md."""

    english: str  # first column, e.g. "chunked prefill"
    zh: str  # second column exactly as written, e.g. "分块预填充" or "`slot_mapping`"
    definition: str
    chapter: str  # link text, e.g. "01"
    chapter_path: Path  # the linked notebook, resolved from docs/
    aliases: tuple[str, ...] = ()  # third column: forms the checks accept too, e.g. ("分块预填充", "分块 prefill")

    @property
    def zh_plain(self) -> str:
        """The preferred Chinese form without markdown backticks, as it reads in text."""
        return self.zh.strip("`")

    @property
    def accepted(self) -> tuple[str, ...]:
        """Every form the checks accept: the preferred one first, then the aliases."""
        return (self.zh_plain, *self.aliases)


def table_rows(markdown: str) -> list[list[list[str]]]:
    """Every pipe table of `markdown`, in order: a list of tables, each a list of rows, each a list of cells.

    The header row is included; the `|---|` separator row is not. Fenced code is skipped.
    """
    tables: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in _FENCE.sub("", markdown).splitlines():
        stripped = line.strip()
        if stripped.startswith("|") and stripped.endswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", stripped[1:-1])]
            if current is None:
                current = []
                tables.append(current)
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        else:
            current = None
    return tables


@functools.lru_cache(maxsize=None)
def _glossary_terms(path: str) -> tuple[GlossaryTerm, ...]:
    text = Path(path).read_text(encoding="utf-8")
    header = ["English term", "中文", "也可写 · also accepted", "definition", "chapter"]
    tables = [t for t in table_rows(text) if t and t[0][:2] == header[:2]]
    if len(tables) != 1:
        raise AssertionError(f"{path}: expected one table headed 'English term | 中文 | ...', found {len(tables)}")
    if tables[0][0] != header:
        raise AssertionError(f"{path}: the glossary's columns must be {' | '.join(header)}, not {tables[0][0]}")
    terms = []
    for row in tables[0][1:]:
        if len(row) != len(header):
            raise AssertionError(f"{path}: a glossary row needs {len(header)} cells, got {len(row)}: {row}")
        link = re.fullmatch(r"\[([^\]]+)\]\(([^)]+)\)", row[4])
        if link is None:
            raise AssertionError(f"{path}: the chapter cell of {row[0]!r} is not one markdown link: {row[4]!r}")
        aliases = () if row[2] in ("", "—") else tuple(a.strip() for a in row[2].split("、"))
        terms.append(
            GlossaryTerm(
                english=row[0],
                zh=row[1],
                definition=row[3],
                chapter=link.group(1),
                chapter_path=(Path(path).parent / link.group(2)).resolve(),
                aliases=aliases,
            )
        )
    return tuple(terms)


def glossary_terms(path: Path | str = GLOSSARY) -> list[GlossaryTerm]:
    """The rows of the glossary table, in order (parsed once per path)."""
    return list(_glossary_terms(str(Path(path).resolve())))


def mask_code(text: str, placeholder: str = "CODE") -> str:
    """`text` with fenced code blocks removed and inline code, URLs and HTML tags replaced.

    Inline code becomes `placeholder` (Latin letters), so "调用`f`" still reads as Chinese touching English;
    a markdown link keeps its text; bold/italic markers are dropped. The learners' verbatim questions
    (LEARNER_ORIGINALS, also when wrapped over lines of a `>` quote) become a pair of quotes.
    """
    text = _FENCE.sub("\n", text)
    for pattern in _ORIGINAL_PATTERNS:
        text = pattern.sub("“”", text)
    text = _INLINE_CODE.sub(placeholder, text)
    text = _LINK.sub(r"\1", text)
    text = _URL.sub(placeholder, text)
    text = _TAG.sub("", text)
    return text.replace("**", "").replace("*", "")


def _context(text: str, start: int, end: int, width: int = 12) -> str:
    return text[max(0, start - width) : end + width].replace("\n", " ")


def glossary_violations(text: str, terms: list[GlossaryTerm] | None = None) -> list[str]:
    """Forms not to use (VARIANTS) found in `text` (code masked): one message per occurrence.

    The glossary's preferred forms and aliases are never reported. A variant is allowed where it lies inside an
    occurrence of an accepted form that contains it (e.g. "预填充" inside "分块预填充").
    """
    terms = glossary_terms() if terms is None else terms
    by_english = {t.english: t for t in terms}
    unknown = sorted(set(VARIANTS) - set(by_english))
    if unknown:
        raise AssertionError(f"VARIANTS names terms that are not in the glossary: {unknown}")
    prose = mask_code(text)
    forms = [form for t in terms for form in t.accepted]
    found: list[tuple[int, int, str]] = []
    for english, variants in VARIANTS.items():
        term = by_english[english]
        advice = " or ".join(repr(f) for f in term.accepted)
        for variant in variants:
            covers = [f for f in forms if variant in f and f != variant]
            allowed: list[tuple[int, int]] = []
            for form in covers:
                allowed += [(m.start(), m.end()) for m in re.finditer(re.escape(form), prose)]
            for m in re.finditer(re.escape(variant), prose):
                if any(s <= m.start() and m.end() <= e for s, e in allowed):
                    continue
                message = (f"{variant!r} is not a glossary form for {english!r}: write {advice} "
                           f"(…{_context(prose, m.start(), m.end())}…)")
                found.append((m.start(), m.end(), message))
    # One message per wrong phrase: "预填充" inside a reported "分段预填充" is not reported again.
    kept = [f for f in found if not any(g[0] <= f[0] and f[1] <= g[1] and g[1] - g[0] > f[1] - f[0] for g in found)]
    return [message for _, _, message in sorted(kept)]


_SPACING = re.compile(rf"(?=([{CJK}][A-Za-z0-9]|[A-Za-z0-9][{CJK}]))")
# Half-width punctuation touching Chinese: after a Chinese character, or before one.
_HALF_WIDTH = re.compile(rf"[{CJK}] ?[,.;:?!()]|[,;:?!()] ?[{CJK}]")


def spacing_violations(text: str) -> list[str]:
    """Places where a Chinese character touches an English letter, a digit or inline code without a space."""
    prose = mask_code(text)
    return [
        f"no space between Chinese and English/digits: …{_context(prose, m.start(), m.start() + 2)}…"
        for m in _SPACING.finditer(prose)
    ]


def punctuation_violations(text: str) -> list[str]:
    """Half-width , . ; : ? ! ( ) written next to Chinese characters (Chinese sentences use ，。；：？！（）)."""
    prose = mask_code(text)
    return [
        f"half-width punctuation in a Chinese sentence: …{_context(prose, m.start(), m.end())}…"
        for m in _HALF_WIDTH.finditer(prose)
    ]


def chinese_problems(text: str, terms: list[GlossaryTerm] | None = None) -> list[str]:
    """All of glossary_violations, spacing_violations and punctuation_violations for `text`."""
    return glossary_violations(text, terms) + spacing_violations(text) + punctuation_violations(text)


def has_chinese(text: str) -> bool:
    return re.search(f"[{CJK}]", text) is not None


# ---- README and docs pages: the English page and its Chinese twin -------------------------------------------------


def fenced_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of `markdown`, fences included, in order."""
    return [m.group(0).strip() for m in _FENCE.finditer(markdown)]


_COMMAND = re.compile(r"^(?:(?:make|python|\.venv/bin/python|pip|conda|nbgrader|source)(?:\s|$)|d=\$\()")


def inline_commands(markdown: str) -> list[str]:
    """Inline code spans of `markdown` that are shell commands (`make …`, `python …`, `pip …`, ...).

    Whitespace is normalised, since a span may wrap across lines.
    """
    body = _FENCE.sub("", markdown)
    spans = [" ".join(m.group(1).split()) for m in re.finditer(r"`([^`]+)`", body)]
    return [s for s in spans if _COMMAND.match(s)]


def inline_code_spans(markdown: str) -> set[str]:
    """Every inline code span of `markdown` (whitespace normalised)."""
    body = _FENCE.sub("", markdown)
    return {" ".join(m.group(1).split()) for m in re.finditer(r"`([^`]+)`", body)}


_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:[ ,\u202f]\d{3})+(?![\d.])")
_NUMBER = re.compile(r"\d+(?:\.\d+)*(?:e[-+]?\d+)?")


def numbers(text: str) -> set[str]:
    """The numbers written in `text`, as strings: "7 429" and "7,429" both give "7429", "1e-3" stays "1e-3".

    Dates and versions split on their separators ("2026-11-30" gives 2026, 11, 30; "0.33.0" stays one).
    """
    text = _THOUSANDS.sub(lambda m: re.sub(r"[ ,\u202f]", "", m.group(0)), text)
    return set(_NUMBER.findall(text))


def headings(markdown: str, level: int) -> list[str]:
    """The headings of exactly `level` (#, ##, ...) outside fenced code, in order."""
    prefix = "#" * level + " "
    return [line[len(prefix) :].strip() for line in _FENCE.sub("", markdown).splitlines() if line.startswith(prefix)]


def course_table(markdown: str) -> list[tuple[str, tuple[str, ...]]]:
    """The course table's rows as (chapter number, the notebooks its cells link to, in order)."""
    for table in table_rows(markdown):
        body = table[1:]
        if body and body[0][0] == "00" and "notebooks/00_welcome.ipynb" in " ".join(body[0]):
            return [(row[0], tuple(re.findall(r"\]\(([^)]+\.ipynb)\)", " ".join(row)))) for row in body]
    raise AssertionError("no course table (a table whose first row is 00 | [...](notebooks/00_welcome.ipynb) | ...)")


def exercise_table(markdown: str) -> list[str]:
    """The chapter numbers of the exercises table (the table whose header has two cells, chapter first)."""
    for table in table_rows(markdown):
        if len(table[0]) == 2 and len(table) > 1 and all(re.fullmatch(r"\d\d", row[0]) for row in table[1:]):
            return [row[0] for row in table[1:]]
    raise AssertionError("no exercises table (two columns, the first a two-digit chapter number)")
