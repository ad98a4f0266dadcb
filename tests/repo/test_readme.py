"""The READMEs are the front door: short, complete, every link live, and nothing they used to say lost.

- **Length.** README.md and README.zh-CN.md each stay within ``WORD_LIMIT`` words of rendered text (code blocks
  included, markup and link targets not). Chinese has no spaces to count by; the rule is: every CJK character counts
  half a word (about two characters per English word, the usual ratio of a translation), and every run of Latin
  letters or digits left once the CJK characters are removed counts one (``rendered_words``).
- **Required pieces.** The prerequisites heading (Linux, Python 3.11 and Ubuntu 22.04's 3.10, the venv package, disk
  and time), ``git clone`` with ``make lab`` and ``make test`` and ``make lab PYTHON=python3.11``, a Python quick
  start that imports ``minillm`` and calls ``LLM(...).generate`` with names that exist, a link to every lesson and
  every exercise notebook, the map of the package, the website (``make book``, ``build/book/index.html``), and a link
  to each page of ``docs/`` and to CONTRIBUTING.
- **Links.** Every relative link of README*.md, CONTRIBUTING*.md and docs/*.md names a file that exists, and an
  anchor into a Markdown file names one of its headings (GitHub's slugs, which the website's MyST uses too).
- **Nothing lost.** The READMEs used to hold the whole manual (before the front-door rewrite of issue 37). ``MOVED``
  lists every ``##``/``###`` heading they had, with the file and heading that hold its text now, and the bold
  lead-ins of its paragraphs and bullets, each of which must still be found there (bold, or as a heading).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README, README_ZH = REPO / "README.md", REPO / "README.zh-CN.md"
WORD_LIMIT = 1000
CJK = "\u3400-\u4dbf\u4e00-\u9fff\u3000-\u303f\uff00-\uffef"  # ideographs, CJK and full-width punctuation
DOCS = ["architecture", "benchmarks", "exercises", "teaching", "serving", "troubleshooting", "website"]

_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[^\n]*$", re.M | re.S)
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def rendered_text(markdown: str) -> str:
    """What a reader sees: code blocks without their fences, links as their text, no markup or table rules."""
    text = _FENCE.sub(lambda m: m.group(2), markdown)
    text = _LINK.sub(lambda m: m.group(1), text)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"(?m)^\s*\|?\s*:?-{3,}.*$", " ", text)  # a table's |---|---| line
    return re.sub(r"[#*`|>]", " ", text)


def rendered_words(markdown: str) -> float:
    """Words of the rendered text: a CJK character counts 1/2, a run of Latin letters or digits (with the ' - . /
    _ inside it, so `minillm/engine/`, "vLLM's" and "0.33.0" are one word each) counts 1."""
    text = rendered_text(markdown)
    cjk = len(re.findall(f"[{CJK}]", text))
    latin = re.findall(r"[A-Za-z0-9]+(?:['’._/\-][A-Za-z0-9]+)*", re.sub(f"[{CJK}]", " ", text))
    return cjk / 2 + len(latin)


def headings(markdown: str) -> list[str]:
    """The text of every heading outside code blocks."""
    body = _FENCE.sub("", markdown)
    return [m.group(2).strip() for m in re.finditer(r"(?m)^(#{1,6})\s+(.+?)\s*#*\s*$", body)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (and MyST's, with myst_heading_anchors): lower case, markup and punctuation
    dropped (letters of every script, digits, '-', '_' and spaces kept), spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(markdown):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(markdown: str) -> list[str]:
    """Every link target outside code blocks and inline code."""
    body = re.sub(r"`[^`\n]*`", "", _FENCE.sub("", markdown))
    return [m.group(2) for m in _LINK.finditer(body)]


def relative_links(markdown: str) -> list[str]:
    return [t for t in links(markdown) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def markdown_files() -> list[Path]:
    return [*sorted(REPO.glob("README*.md")), *sorted(REPO.glob("CONTRIBUTING*.md")),
            *sorted((REPO / "docs").glob("*.md"))]


@pytest.fixture(scope="module", params=["README.md", "README.zh-CN.md"])
def readme(request) -> tuple[str, str]:
    return request.param, (REPO / request.param).read_text(encoding="utf-8")


# ---- the counting rule itself ----------------------------------------------------------------------------------


def test_word_count_rule():
    # Set, up, Run, make, lab, the, docs
    assert rendered_words("## Set up\n\nRun `make lab` ([the docs](docs/x.md)).") == 7
    assert rendered_words("```\nmake lab     # opens JupyterLab\n```") == 4
    assert rendered_words("| a | b |\n|---|---|\n| vLLM's | 0.33.0 |") == 4
    assert rendered_words("每个块有 16 个 token。") == 3 + 2  # 6 CJK characters (the 。 included) and 2 words


# ---- length and required pieces ---------------------------------------------------------------------------------


def test_readme_within_its_length(readme):
    name, text = readme
    words = rendered_words(text)
    assert words <= WORD_LIMIT, (
        f"{name} has {words:.0f} words (CJK characters count 1/2); the limit is {WORD_LIMIT}: "
        "move what a newcomer does not need first to a page of docs/ and link it")


def test_readme_has_prerequisites(readme):
    name, text = readme
    prereq = "Prerequisites" if name == "README.md" else "环境要求"
    assert prereq in headings(text), f"{name}: no '{prereq}' heading"
    section = text.split(f"## {prereq}", 1)[1].split("\n## ", 1)[0]
    for words in ("Linux", "WSL2", "macOS", "3.11", "22.04", "3.10", "python3-venv", "make lab PYTHON=python3.11",
                  "GB", "~/.cache/minillm", "make test"):
        assert words in section, f"{name}, {prereq}: {words!r} missing"


def test_readme_has_clone_and_the_two_commands(readme):
    name, text = readme
    blocks = [m.group(2) for m in _FENCE.finditer(text)]
    setup = next((b for b in blocks if "git clone" in b), None)
    assert setup is not None, f"{name}: no code block with git clone"
    lines = [line.split("#")[0].strip() for line in setup.splitlines()]
    assert "make lab" in lines and "make test" in lines, f"{name}: the clone block must run make lab and make test"


def test_quick_start_runs_against_the_real_api(readme):
    """The Python block imports from minillm, builds an LLM and calls generate, with names and arguments that
    exist (checked on the package, without loading the model: the snippet itself was run when it was written)."""
    import dataclasses
    import inspect

    import minillm

    name, text = readme
    blocks = [m.group(1) for m in re.finditer(r"(?ms)^```python\n(.*?)^```", text)]
    assert blocks, f"{name}: no ```python quick start"
    tree = ast.parse(blocks[0])
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "minillm"
                for a in n.names]
    assert "LLM" in imported, f"{name}: the quick start must import LLM from minillm"
    for n in imported:
        assert hasattr(minillm, n), f"{name}: minillm has no {n}"
    calls = {n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id: n
             for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))}
    assert "generate" in calls and "LLM" in calls, f"{name}: the quick start must call LLM(...).generate"
    assert all(p in inspect.signature(minillm.LLM.generate).parameters for p in ("prompts", "sampling_params"))
    if "SamplingParams" in calls:
        fields = {f.name for f in dataclasses.fields(minillm.SamplingParams)}
        kwargs = {k.arg for k in calls["SamplingParams"].keywords}
        assert kwargs <= fields, f"{name}: SamplingParams has no {kwargs - fields}"
        minillm.SamplingParams(**{k.arg: ast.literal_eval(k.value) for k in calls["SamplingParams"].keywords})
    assert "if __name__ == \"__main__\":" in blocks[0], "LLM spawns its engine core: a script needs the main guard"


def test_readme_links_every_lesson_and_exercise(readme):
    name, text = readme
    targets = set(relative_links(text))
    for folder in ("notebooks", "exercises"):
        for nb in sorted((REPO / folder).glob("*.ipynb")):
            assert f"{folder}/{nb.name}" in targets, f"{name}: no link to {folder}/{nb.name}"


def test_readme_maps_the_package_and_the_website(readme):
    name, text = readme
    for words in ("minillm/engine/", "minillm/core/", "minillm/worker/", "minillm/course/", "kernels/",
                  "make book", "build/book/index.html"):
        assert words in text, f"{name}: {words!r} missing"


def test_readme_links_every_docs_page(readme):
    name, text = readme
    targets = set(relative_links(text))
    suffix = ".md" if name == "README.md" else ".zh-CN.md"
    wanted = [f"docs/{page}{suffix}" for page in DOCS] + [f"CONTRIBUTING{suffix}", "docs/glossary.md"]
    missing = [w for w in wanted if w not in targets]
    assert not missing, f"{name}: no link to {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    targets = set(relative_links(README.read_text(encoding="utf-8")))
    pages = [p for p in sorted((REPO / "docs").glob("*.md")) if not p.name.endswith(".zh-CN.md")]
    unlinked = [p.name for p in pages if f"docs/{p.name}" not in targets and p.name not in
                {"maintaining-the-glossary.md"}]
    assert not unlinked, f"docs pages no README link leads to: {unlinked}"


# ---- every relative link resolves --------------------------------------------------------------------------------


def test_every_relative_link_resolves():
    problems = []
    for md in markdown_files():
        for target in relative_links(md.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                problems.append(f"{md.relative_to(REPO)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{md.relative_to(REPO)}: {target} (no heading with that anchor)")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_check_can_fail(tmp_path):
    md = "# Page\n\n## Two words\n\n[ok](#two-words) [bad](#three-words) [gone](nowhere.md) `[code](x.md)`\n"
    assert relative_links(md) == ["#two-words", "#three-words", "nowhere.md"]
    assert "two-words" in anchors(md) and "three-words" not in anchors(md)
    assert slug("在中国大陆安装") == "在中国大陆安装" and slug("Before `--host 0.0.0.0`") == "before---host-0000"


# ---- nothing lost ---------------------------------------------------------------------------------------------
# (old file, old heading) -> [(new file, heading there)], [bold lead-ins of the old section, each found again in one
# of the new files, bold or as a heading]. The headings are every ## and ### of README.md and README.zh-CN.md as
# they stood before the rewrite (commit c867a00).

MOVED: list[tuple[str, str, list[tuple[str, str]], list[str]]] = [
    ("README.md", "Prerequisites", [("README.md", "Prerequisites"), ("docs/troubleshooting.md", "Troubleshooting")],
     ["Linux", "Python 3.11 or newer", "Disk", "Time", "Python older than 3.11, or no `venv` module."]),
    ("README.md", "Set up", [("README.md", "Set up"), ("docs/troubleshooting.md", "Troubleshooting")],
     ["The first model load takes about 12 s."]),
    ("README.md", "Read it as a website", [("docs/website.md", "Read it as a website"), ("README.md", "The website")],
     []),
    ("README.md", "The course", [("README.md", "The course"), ("docs/architecture.md", "How the engine is built"),
                                 ("docs/benchmarks.md", "Tensor parallelism inside the engine")],
     ["Which vLLM.", "The engine core, in its own process or in yours.", "The package reads as the engine's diagram.",
      "Tensor parallelism inside the engine."]),
    ("README.md", "What the chapters measure", [("docs/benchmarks.md", "What the chapters measure")],
     ["00 · welcome.", "01 · attention and chunks.", "02 · paged KV cache.", "03 · Triton kernel.", "04 · scheduler.",
      "05 · sampler.", "06 · engine.", "06 · the engine core in its own process.", "07 · context parallelism.",
      "09 · disaggregation and tensor parallelism.", "At the dtype the CPU is built for."]),
    ("README.md", "Exercises", [("docs/exercises.md", "Exercises"), ("docs/teaching.md", "Editing the exercises")],
     ["The answer lint", "The tripwire", "Grading out of the answer's reach", "The capstone"]),
    ("README.md", "For teachers", [("docs/teaching.md", "For teachers"),
                                   ("docs/teaching.md", "What grading cannot stop")],
     ["Without nbgrader.", "With nbgrader", "Build the course directory", "Open the formgrader", "Generate",
      "Release and collect", "Autograde", "Feedback"]),
    ("README.md", "Serving safely", [("docs/serving.md", "Serving safely")],
     ["Other programs and web pages on your machine.", "An API key.", "Before `--host 0.0.0.0`",
      "Careless or hostile clients.", "Stopping."]),
    ("README.md", "Troubleshooting", [("docs/troubleshooting.md", "Troubleshooting")],
     ["No GPU.", "The Triton interpreter is slow.", "macOS or Windows.", "conda users.",
      "A newer torch gets pulled in.", "Nothing downloads.", "Chinese text shows as boxes."]),
    ("README.md", "Contributing", [("CONTRIBUTING.md", "Contributing")],
     ["No stored output may depend on the machine.", "Before you store a notebook, run `make test-portable`.",
      "Widgets are judged in a browser.", "Tensor parallelism on SmolLM2 is `make test-tp`."]),
    ("README.zh-CN.md", "环境要求", [("README.zh-CN.md", "环境要求"), ("docs/troubleshooting.zh-CN.md", "常见问题")],
     ["Linux", "Python 3.11 或更新的版本", "磁盘", "时间", "Python 低于 3.11，或者没有 `venv` 模块。"]),
    ("README.zh-CN.md", "准备环境", [("README.zh-CN.md", "准备环境"), ("docs/troubleshooting.zh-CN.md", "常见问题")],
     ["第一次加载模型要约 12 秒。"]),
    ("README.zh-CN.md", "在中国大陆安装", [("docs/troubleshooting.zh-CN.md", "在中国大陆安装")],
     ["不需要 Hugging Face。", "CPU 版 torch 也要换源。", "conda 用户几乎每个包都走 pip。"]),
    ("README.zh-CN.md", "网页版", [("docs/website.zh-CN.md", "网页版"), ("README.zh-CN.md", "网页版")], []),
    ("README.zh-CN.md", "课程内容", [("README.zh-CN.md", "课程内容"),
                                  ("docs/architecture.zh-CN.md", "引擎是怎样搭起来的"),
                                  ("docs/benchmarks.zh-CN.md", "引擎内部的张量并行")],
     ["对应哪个 vLLM。", "engine core：在它自己的进程里，或在你的进程里。", "包的目录就是引擎的结构图。",
      "引擎内部的张量并行。"]),
    ("README.zh-CN.md", "各章测了什么", [("docs/benchmarks.zh-CN.md", "各章测了什么")],
     ["00 · 欢迎（welcome）。", "01 · attention 与 chunk。", "02 · 分页 KV cache。", "03 · Triton kernel。",
      "04 · 调度器。", "05 · 采样器。", "06 · 引擎。", "06 · 在单独进程里的 engine core。", "07 · 上下文并行。",
      "09 · PD 分离和张量并行。", "按 CPU 擅长的 dtype 运行。"]),
    ("README.zh-CN.md", "练习", [("docs/exercises.zh-CN.md", "练习"), ("docs/teaching.zh-CN.md", "编辑练习")],
     ["答案检查（lint，`lint.py`）", "绊线（`tripwire.py`）", "答案够不着的评分（`grading.py`）", "综合项目"]),
    ("README.zh-CN.md", "给老师", [("docs/teaching.zh-CN.md", "给老师"), ("docs/teaching.zh-CN.md", "批改拦不住什么")],
     ["不用 nbgrader。", "用 nbgrader。", "建立课程目录", "打开 formgrader", "生成", "发放和收集", "自动批改", "反馈"]),
    ("README.zh-CN.md", "安全地对外服务", [("docs/serving.zh-CN.md", "安全地对外服务")],
     ["你机器上的其他程序和网页。", "API key。", "使用 `--host 0.0.0.0` 之前", "粗心或恶意的客户端。", "停止。"]),
    ("README.zh-CN.md", "常见问题", [("docs/troubleshooting.zh-CN.md", "常见问题")],
     ["没有 GPU。", "Triton 解释器很慢。", "macOS 或 Windows。", "conda 用户。", "pip 装了别的 torch。",
      "什么都不用下载。", "中文显示成方框。"]),
    ("README.zh-CN.md", "参与贡献", [("CONTRIBUTING.zh-CN.md", "参与贡献")],
     ["保存的输出不能依赖机器。", "保存 notebook 之前，运行 `make test-portable`。", "widget 要在浏览器里检验。",
      "SmolLM2 上的张量并行用 `make test-tp` 测。"]),
]


def _lead_found(lead: str, texts: list[str]) -> bool:
    bare = lead.rstrip(".。")
    return any(f"**{lead}**" in t or f"**{bare}**" in t or bare in headings(t) for t in texts)


@pytest.mark.parametrize("old_file, old_heading, homes, leads", MOVED, ids=[f"{m[0]}: {m[1]}" for m in MOVED])
def test_every_old_readme_section_has_a_home(old_file, old_heading, homes, leads):
    texts = []
    for path, heading in homes:
        text = (REPO / path).read_text(encoding="utf-8")
        assert heading in headings(text), f"{old_file} '{old_heading}' moved to {path} '{heading}': no such heading"
        texts.append(text)
    lost = [lead for lead in leads if not _lead_found(lead, texts)]
    assert not lost, f"{old_file} '{old_heading}': these paragraphs are in none of {[h[0] for h in homes]}: {lost}"


def test_moved_lists_every_old_heading():
    """MOVED covers the old headings exactly once each (the list the rewrite started from)."""
    old = [(m[0], m[1]) for m in MOVED]
    assert len(old) == len(set(old)) == 10 + 11
