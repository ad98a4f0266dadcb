"""Every vLLM path, class and function the course cites exists in the vLLM release it maps to (v0.33.0).

The course promises that a learner can open vLLM next and find the same names doing the same things; a path that
moved or a class that was renamed breaks that promise silently. This test reads a committed index of vLLM 0.33.0
(``tests/data/vllm-0.33.0-index.json``, made by ``scripts/vllm_index.py`` from the unpacked wheel: every
``vllm/**/*.py`` path, its top-level names, and its classes' members), so it runs offline in well under a second.

Where it looks: the markdown and code cell sources (never outputs) of ``notebooks/*.ipynb`` and
``solutions/*.ipynb``, ``README.md``, ``CONTRIBUTING.md``, the English pages of ``docs/``, ``minillm/**/*.py`` and
``kernels/**/*.py``. (``exercises/`` is generated from ``solutions/``; the Chinese pages may cite only what their
English twins cite, which tests/repo/test_chinese.py checks.)

What counts as a vLLM path (:data:`PATH_RE`): ``vllm/`` not preceded by a word character, ``.``, ``/`` or ``-``
(so ``github.com/vllm-project/vllm/...`` and ``minillm/`` are not paths), followed by path characters; trailing
``.`` and ``-`` are sentence punctuation, not part of it.

- ``vllm/a/b.py`` must be a file of the index.
- ``vllm/a/b/`` (trailing slash) must be a directory: some indexed file lies under it.
- ``vllm/a/b`` (no suffix) is a module path: a directory or ``vllm/a/b.py``.
- Any other suffix (``.cu``, ``.json``) names a file the index does not hold; it is not checked.

What counts as a vLLM name *beside* a path (the name is then looked up in that file; beside a directory, in any
file under it). A *span* is a backtick code span (single backticks in markdown, double in docstrings); a *name* is
a span holding an identifier or ``Class.member``, optionally followed by a call's parentheses
(```unified_attention(..., cu_seqlens_q)``` names ``unified_attention``).

1. Inline, in the path itself: ``vllm/a.py:Name``, ``vllm/a.py:Class.method``, ``vllm/a.py::Name``, or a path
   span that goes on with a name after a space (```vllm/a.py Name```).
2. After the path: the spans that follow the path's span, each separated from the previous one by nothing but
   whitespace, ``,``, ``:``, ``(`` or ``and``: ```vllm/a.py` `Name```, ```vllm/a.py` (`A`, `B.c`)``,
   ```vllm/a.py`: `A`, `B``` and ```vllm/a.py` (`Cls`: `m1`, `m2`)``. The list stops at any other text
   (``(token budget, `x`)`` names nothing, ```A` with its `x``` names only ``A``), at a span that is neither a
   name nor a relative file, and at a name that rule 3 gives to the next vLLM path (```A` lives in `vllm/b.py```).
3. Before the path: ```Name` in `vllm/a.py```, ``of``, ``from``, also after a verb (```Name` lives in
   `vllm/a.py```, ``is defined in``), extended backwards over ``,``/``and`` lists (```A` and `B` of `vllm/a.py```);
   and ```Name` (`vllm/a.py`)`` when ``Name`` is class-like: capitalised, ``Class.member`` or a call
   (```get_pcp_group()` (`vllm/...`)``). A plain lower-case span before a parenthesised path is usually a
   variable or a concept shown there (```logits_indices` (`vllm/v1/worker/gpu_model_runner.py`)``), not a claim
   that the file defines it, so it is not checked.
4. A relative file after a path: in the list of rule 2, a span like ```core.py``` or ```ops/penalties.py```
   (``.py`` or trailing ``/``, not starting with ``vllm/``, ``minillm/`` or ``kernels/``) names a vLLM file next
   to the last path: it is looked for in that path's directory, then in each directory above it up to ``vllm/``
   (```vllm/v1/sample/ops/topk_topp_sampler.py`, `ops/penalties.py``` is ``vllm/v1/sample/ops/penalties.py``),
   and failing that it may be the one vLLM file whose path ends with it (```gpu_model_runner.py``` anywhere:
   a unique name any file search finds; ```processor.py``` is not unique). The names after it (rule 2) belong to
   it. Besides rule 2's separators, a relative file may follow ``),``, ``;`` or ``, with``:
   ```vllm/v1/engine/llm_engine.py`, `core.py` (`EngineCore.step`), `processor.py```.

A bare name must be a top-level name of the file or a member of one of its classes (```vllm/a.py`
(`GPUModelRunner`: `_prepare_inputs`)``); ``Class.member`` must be a member of that class there (methods, class
attributes, fields and ``self.x`` attributes count; a member inherited from a class in another file does not: the
learner would not find it in the cited file). *Defined* means defined, not imported: a name a file only imports and
calls (```flash_attn.py` (`flash_attn_varlen_func`)``) is reported with the file that defines it; to mention what
a file uses, say so in words, which ends rule 2's list (```flash_attn.py`, which calls `flash_attn_varlen_func```).

Older releases: the course may say, in one line, where an older release kept something (a learner may have read it).
A path whose *clause* says so is not checked against 0.33.0, nor are the names beside it. The clause is the text
around the path up to the nearest ``;``, ``(``, ``)``, ``|``, blank line or sentence end; it says so when it matches
:data:`HISTORICAL_RE` ("older releases", "earlier versions", "older ones", "before v0.10", ...):
``(older releases: `vllm/attention/ops/`)`` is exempt, ```vllm/attention/ops/x.py`; `vllm/v1/...` in recent
releases`` is not.

Deprecated features. A name can outlive its feature: v0.33.0 still defines ``ModelConfig.disable_cascade_attn``
("Deprecated: cascade attention has been removed, so this has no effect"), ``GPUModelRunner.cascade_attn_enabled``
and ``SchedulerOutput.num_common_prefix_blocks`` ("always empty"), so the checks above pass a course that teaches
cascade attention as current. The index also holds what 0.33.0's docstrings, comments and flag messages mark as
deprecated, removed or without effect, each attached to the name it documents (``scripts/vllm_index.py``,
"Deprecation markers"), and :func:`test_course_names_no_removed_feature_as_current` fails a sentence that names one
of them as current. The rule:

- Where: the prose of the course, not its code: markdown cells of ``notebooks/*.ipynb`` and ``solutions/*.ipynb``
  and the comments of their code cells, ``README*.md``, ``CONTRIBUTING*.md``, ``docs/*.md``, and the docstrings and
  comments of ``minillm/**/*.py`` and ``kernels/**/*.py``.
- The unit is a sentence (:func:`sentences`): text up to ``.``/``!``/``?`` before a space (not in "e.g.", "i.e.",
  "vs.", "etc.", "cf."), ``。！？``, a table cell's ``|``, a blank line, or a line that starts a list item, a
  heading or a table row. A table row is judged cell by cell: "removed" in another cell does not excuse this one.
- A sentence *names a gone feature* when it holds (:class:`DeprecationGuard`):
  a marked ``Class.member`` (``SchedulerOutput.num_common_prefix_blocks``); a marked bare identifier, if it has an
  underscore and every place 0.33.0 defines it is marked (``num_common_prefix_blocks``, ``cascade_attn_enabled``,
  ``use_cascade_attn``; not ``device``, which 173 other classes define), or if 0.33.0's CLI calls its flag deprecated
  (``disable_cascade_attn``; also written ``--disable-cascade-attn``); the path of a file whose module docstring is
  marked; or a curated feature phrase (:data:`FEATURE_PHRASES`: "cascade attention", "common prefix blocks",
  "multi-step scheduling", with their Chinese forms), each derived from a marker that names it
  (:func:`test_feature_phrases_derive_from_markers`).
- Such a sentence passes only when the same sentence marks it as history (:data:`HISTORY_WORDS_RE`): removed,
  deprecated, gone, dropped, formerly, was/were/had, used to, no longer, no effect, always empty, older (or earlier,
  previous) releases, until/before vX.Y; 已移除, 已删除, 废弃, 弃用, 旧版本, 早期版本, 以前, 曾, 不再, 过去. The
  past tense is deliberately enough ("Older releases also used it for cascade attention"); a history word in the
  next sentence is not ("Cascade attention computes a shared prefix once. It has been removed." fails).
- A failure lists each sentence as ``file (cell N (id X) | line N): "sentence" — `what`: file:name says "..."``.

Locations: ``cell N`` is the 0-based index of the notebook cell (as in ``nb["cells"][N]`` and the issues' ``cN``);
``line N`` is 1-based in text files. A failure lists every bad reference, one a line, as
``file (cell N): reference — why``, with the file where 0.33.0 defines the name or keeps a file of that name when
the index knows one, so a writer fixes them all in one pass.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.33.0"
INDEX_FILE = REPO / "tests" / "data" / f"vllm-{VLLM_VERSION}-index.json"

# ----------------------------------------------------------------------------------------------------------------
# Extraction: text -> citations. Pure functions of a string, unit-tested below on small strings.
# ----------------------------------------------------------------------------------------------------------------

PATH_RE = re.compile(r"(?<![\w./-])vllm/[\w./-]*")
# Rule 1: `:Name` / `::Name` right after a path anywhere; inside the path's own span also ` Name` (and a call).
INLINE_NAME_RE = re.compile(r"::?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
IN_SPAN_NAME_RE = re.compile(r"(?:::?|[ \t]+)([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)(?:\(.*\))?", re.S)
# A code span: a run of backticks, content without a blank line, the same run of backticks (CommonMark's rule).
SPAN_RE = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
NAME_SPAN_RE = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)(?:\(.*\))?", re.S)
RELATIVE_RE = re.compile(r"(?!(?:vllm|minillm|kernels|tests|notebooks|solutions|exercises)/)\w+(?:/\w+)*(?:\.py|/)")
# Gaps between spans. Names continue a list after NAME_GAP; a relative file may also follow FILE_GAP.
NAME_GAP = re.compile(r"\s*(?:[,:(]|,?\s*and)?\s*")
FILE_GAP = re.compile(r"\s*\)?\s*(?:[,;(:]|,?\s*and|,?\s*with)?\s*")
# Rule 3: `Name` (`path`) (class-like names only), `Name` [lives|is defined|...] in/of/from `path`.
BACK_PAREN_GAP = re.compile(r"\s*\(\s*")
BACK_WORD_GAP = re.compile(r"\s+(?:(?:is|are|lives?|defined|declared|kept|found)\s+)*(?:in|of|from)\s+")
BACK_LIST_GAP = re.compile(r"\s*,\s*|\s*,?\s+and\s+")
CLAUSE_START = re.compile(r"[;()|]|\n[ \t]*\n|[.!?](?=\s)")
HISTORICAL_RE = re.compile(
    r"\b(?:older|earlier|previous|prior|past)\s+(?:releases?|versions?|ones)\b"
    r"|\b(?:before|until|up\s+to|pre-?)\s*v?0\.\d+", re.I)


@dataclass
class Item:
    """One thing a citation names: the vLLM path itself, a name beside it, or a file relative to it."""

    kind: str  # "path", "name" or "file"
    text: str
    offset: int  # where it starts in the scanned text, for the location in the message


@dataclass
class Citation:
    """A vLLM path with what is cited beside it, in reading order: each name belongs to the last path/file."""

    items: list[Item] = field(default_factory=list)
    historical: bool = False

    def simple(self) -> list[str]:
        """A compact form for the unit tests: ``["vllm/a.py", "Name", "+b.py", "Other"]``."""
        return [("+" if i.kind == "file" else "") + i.text for i in self.items]


def _spans(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, content)`` of every code span; ``end`` is past the closing backticks."""
    return [(m.start(), m.end(), m.group(2).strip()) for m in SPAN_RE.finditer(text)]


def _name_of(content: str) -> str | None:
    """The identifier a span names, or ``None`` (a file name such as ``core.py`` is not a ``Class.member``)."""
    if content.endswith(".py"):
        return None
    m = NAME_SPAN_RE.fullmatch(content)
    return m.group(1) if m else None


def _is_historical(text: str, start: int, end: int) -> bool:
    """Whether the clause around ``text[start:end]`` says it is about an older release."""
    before = [m.end() for m in CLAUSE_START.finditer(text, 0, start)]
    after = CLAUSE_START.search(text, end)
    clause = text[before[-1] if before else 0: after.start() if after else len(text)]
    return bool(HISTORICAL_RE.search(clause))


def extract_citations(text: str) -> list[Citation]:
    """Every vLLM path in ``text`` with the names and relative files beside it (see the module docstring)."""
    spans = _spans(text)
    citations: list[Citation] = []
    path_spans: list[int | None] = []  # the span each citation's walks start from
    for m in PATH_RE.finditer(text):
        path = m.group(0).rstrip(".-")
        start, end = m.start(), m.start() + len(path)
        cit = Citation(items=[Item("path", path, start)])
        # Rule 1: a name in the path itself.
        inline = INLINE_NAME_RE.match(text, end)
        span_k = next((k for k, (s, e, _) in enumerate(spans) if s <= start < e), None)
        if span_k is not None:
            s, e, content = spans[span_k]
            rest = content[content.index(path) + len(path):] if path in content else None
            if content.startswith(path) and rest is not None:
                # The span is the path (plus perhaps an inline name): the walks go from the span's ends.
                inline = IN_SPAN_NAME_RE.fullmatch(rest) if rest else None
                if rest and not inline:
                    span_k = None  # a longer span (a command line, code): the path alone, no walks
                start, end = s, e
            else:
                span_k = None
        if inline:
            cit.items.append(Item("name", inline.group(1), m.start()))
        if span_k is not None:
            cit.items.extend(_walk_forward(text, spans, span_k))
        cit.historical = _is_historical(text, start, end)
        citations.append(cit)
        path_spans.append(span_k)
    # Backward walks last: a list that a path's forward walk already took (```vllm/a.py` (`A`, `B` lives in
    # `vllm/b.py`)``: `A` is a.py's) is not extended into by the next path's backward walk.
    claimed = {item.offset for cit in citations for item in cit.items[1:]}
    for cit, span_k in zip(citations, path_spans):
        if span_k is not None:
            cit.items[1:1] = _walk_back(text, spans, span_k, claimed)
    return citations


def _class_like(content: str) -> bool:
    """``Class``, ``Class.member`` or ``call()``: a span that names an API, not a variable or a concept."""
    return "(" in content or "." in content or content[:1].isupper()


def _walk_back(text: str, spans: list[tuple[int, int, str]], k: int, claimed: set[int]) -> list[Item]:
    """Rule 3: ```Name` (`path`)``, ```A` and `B` in `path```; spans in ``claimed`` belong to another path."""
    found: list[Item] = []
    first = True
    while k > 0:
        s, e, content = spans[k - 1]
        name = _name_of(content)
        gap = text[e:spans[k][0]]
        if name is None or s in claimed:
            break
        if first:
            # `x` (`path`) with a plain lower-case `x` is usually a variable or a concept shown in that file
            # (`logits_indices` (`gpu_model_runner.py`)); a class, method or call before "(" is a citation.
            if not (BACK_WORD_GAP.fullmatch(gap) or (BACK_PAREN_GAP.fullmatch(gap) and _class_like(content))):
                break
        elif not BACK_LIST_GAP.fullmatch(gap):
            break
        found.insert(0, Item("name", name, s))
        first, k = False, k - 1
    return found


def _walk_forward(text: str, spans: list[tuple[int, int, str]], k: int) -> list[Item]:
    """Rules 2 and 4: names and relative files in the list that follows the path's span."""
    found: list[Item] = []
    while k + 1 < len(spans):
        gap = text[spans[k][1]:spans[k + 1][0]]
        s, e, content = spans[k + 1]
        if PATH_RE.match(content):
            break  # another vLLM path: its own citation
        name = _name_of(content)
        if name is not None and NAME_GAP.fullmatch(gap):
            if k + 2 < len(spans) and PATH_RE.match(spans[k + 2][2]) and (
                    BACK_WORD_GAP.fullmatch(text[e:spans[k + 2][0]])
                    or (BACK_PAREN_GAP.fullmatch(text[e:spans[k + 2][0]]) and _class_like(content))):
                break  # `Name` in `vllm/other.py`: rule 3 gives it to the other path
            found.append(Item("name", name, s))
        elif RELATIVE_RE.fullmatch(content) and FILE_GAP.fullmatch(gap):
            found.append(Item("file", content, s))
        else:
            break
        k += 1
    return found


# ----------------------------------------------------------------------------------------------------------------
# The index and the checks
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class VllmIndex:
    """vLLM's files, directories and names, read from the committed index (format: ``scripts/vllm_index.py``)."""

    version: str
    files: dict[str, tuple[set[str], dict[str, set[str]]]]
    dirs: set[str]
    deprecated: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> marked name -> what vLLM says
    deprecated_in: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> scope -> a marker inside it

    @classmethod
    def load(cls, path: Path = INDEX_FILE) -> VllmIndex:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = {p: _parse_entry(entry) for p, entry in data["files"].items()}
        dirs = {p[:i + 1] for p in files for i, ch in enumerate(p) if ch == "/"}
        return cls(data["version"], files, dirs, data.get("deprecated", {}), data.get("deprecated_in", {}))

    def definitions(self) -> dict[str, set[tuple[str, str]]]:
        """Every place a name is defined, as ``(file, Name or Class.member)``, keyed by the bare name."""
        out: dict[str, set[tuple[str, str]]] = {}
        for f, (top, classes) in self.files.items():
            for name in top:
                if name not in classes:
                    out.setdefault(name, set()).add((f, name))
            for cls_name, members in classes.items():
                out.setdefault(cls_name, set()).add((f, cls_name))
                for member in members:
                    out.setdefault(member, set()).add((f, f"{cls_name}.{member}"))
        return out

    def resolve(self, path: str) -> tuple[str, list[str]] | None:
        """``(canonical path, files to look names up in)``, or ``None`` when the path does not exist."""
        if path.endswith(".py"):
            return (path, [path]) if path in self.files else None
        if path.endswith("/"):
            return (path, self._under(path)) if path in self.dirs else None
        if path + ".py" in self.files:
            return path + ".py", [path + ".py"]
        if path + "/" in self.dirs:
            return path + "/", self._under(path + "/")
        return None

    def _under(self, directory: str) -> list[str]:
        return [p for p in self.files if p.startswith(directory)]

    def defines(self, files: list[str], name: str) -> tuple[bool, str]:
        """Whether one of ``files`` defines ``name`` (``Name`` or ``Class.member``); else a short reason."""
        cls_name, _, member = name.rpartition(".")
        for f in files:
            top, classes = self.files[f]
            if not cls_name and (name in top or any(name in m for m in classes.values())):
                return True, ""
            if cls_name and member in classes.get(cls_name, ()):
                return True, ""
            if cls_name and cls_name in top and cls_name not in classes:
                return True, ""  # an alias (`Foo = Bar`): its members are not indexed, trust the citation
        if cls_name and any(cls_name in self.files[f][1] for f in files):
            return False, f"`{cls_name}` there has no member `{member}`"
        return False, "not defined there"

    def where_defined(self, name: str) -> tuple[str, ...]:
        """Files that define ``name``: as a top-level name (or, for ``Class.member``, as that class's member)."""
        cls_name, _, member = name.rpartition(".")
        if cls_name:
            found = sorted(p for p, (_, classes) in self.files.items() if member in classes.get(cls_name, ()))
            # Not in that class anywhere: perhaps inherited, or moved to another class; say which classes have it.
            return tuple(found) if found else self.where_defined(member)
        found = sorted(p for p, (top, _) in self.files.items() if name in top)
        if not found:  # a method named bare: say which classes have it
            found = sorted(f"{p} ({c})" for p, (_, classes) in self.files.items()
                           for c, members in classes.items() if name in members)
        return tuple(found)

    def same_basename(self, path: str) -> list[str]:
        """Files (or directories) of 0.33.0 whose last component is the missing path's: likely where it moved."""
        base = path.rstrip("/").rsplit("/", 1)[-1]
        if path.endswith("/"):
            return sorted(d for d in self.dirs if d.rstrip("/").rsplit("/", 1)[-1] == base)
        base = base if base.endswith(".py") else base + ".py"
        return sorted(p for p in self.files if p.rsplit("/", 1)[-1] == base)


def _parse_entry(entry: str) -> tuple[set[str], dict[str, set[str]]]:
    """One file's entry: top-level names, then ``Class:`` and its members (see ``scripts/vllm_index.py``)."""
    top: set[str] = set()
    classes: dict[str, set[str]] = {}
    current: set[str] | None = None
    for word in entry.split():
        if word.endswith(":"):
            current = classes.setdefault(word[:-1], set())
            top.add(word[:-1])
        elif current is None:
            top.add(word)
        else:
            current.add(word)
    return top, classes


def _closest(options: list[str] | tuple[str, ...], near: str) -> list[str]:
    """``options`` with those sharing the most leading directories with ``near`` first (the likely move)."""
    near_parts = near.split("/")

    def shared(option: str) -> int:
        n = 0
        for a, b in zip(option.split("/"), near_parts):
            if a != b:
                break
            n += 1
        return n

    return sorted(options, key=lambda o: (-shared(o), len(o), o))


def _hint(options: list[str] | tuple[str, ...], what: str, near: str) -> str:
    if not options:
        return ""
    options = _closest(options, near)
    shown = ", ".join(options[:3]) + (f", … ({len(options)} in all)" if len(options) > 3 else "")
    return f"; {what} {shown}"


def check_citation(index: VllmIndex, cit: Citation) -> list[tuple[int, str, str]]:
    """``(offset, reference, why)`` for each thing the citation names that 0.33.0 does not have."""
    if cit.historical:
        return []
    head = cit.items[0]
    resolved = index.resolve(head.text)
    if resolved is None:
        kind = "directory" if head.text.endswith("/") else "file"
        why = f"no such {kind} in vLLM {index.version}" + _hint(
            index.same_basename(head.text), "same name at", head.text)
        # The names beside it say best where it went: the file that defines them now.
        for item in cit.items[1:]:
            if item.kind == "name":
                why += _hint(index.where_defined(item.text), f"`{item.text}` is in", head.text) or \
                    f"; `{item.text}` is defined nowhere in vLLM {index.version}"
            else:
                why += f"; `{item.text}` beside it is checked once the path is fixed"
        return [(head.offset, head.text, why)]
    problems = []
    anchor, files = resolved
    last_found = anchor  # a relative file after a missing one is still looked for next to the last file found
    for item in cit.items[1:]:
        if item.kind == "file":
            base = last_found if last_found.endswith("/") else last_found.rsplit("/", 1)[0] + "/"
            anchor, files = _resolve_relative(index, last_found, item.text)
            if anchor is not None:
                last_found = anchor
            else:
                why = f"no such file next to `{base}` or above it, nor a unique file of that name" + _hint(
                    index.same_basename(item.text), "same name at", base)
                problems.append((item.offset, f"{item.text} (after {last_found})", why))
            continue
        if anchor is None:
            continue  # a name after a missing relative file: that file is reported already
        ok, why = index.defines(files, item.text)
        if not ok:
            elsewhere = index.where_defined(item.text)
            why += _hint(elsewhere, "defined in", anchor)
            if not elsewhere:
                why += f"; defined nowhere in vLLM {index.version}"
            cls_name = item.text.rpartition(".")[0]
            homes = [p for p in index.where_defined(cls_name) if p not in files] if cls_name else []
            why += _hint(homes, f"class `{cls_name}` is in", anchor)
            problems.append((item.offset, f"{anchor}:{item.text}", why))
    return problems


def _resolve_relative(index: VllmIndex, anchor: str, rel: str) -> tuple[str | None, list[str]]:
    """Rule 4: ``rel`` in the anchor's directory, or the nearest directory above it that has it, or else the one
    vLLM file whose path ends with ``/rel`` (a unique file name a learner finds with any file search)."""
    directory = anchor if anchor.endswith("/") else anchor.rsplit("/", 1)[0] + "/"
    while directory.startswith("vllm/"):
        resolved = index.resolve(directory + rel)
        if resolved is not None:
            return resolved
        directory = directory[:-1].rsplit("/", 1)[0] + "/" if directory != "vllm/" else ""
    matches = [p for p in (index.dirs if rel.endswith("/") else index.files) if p.endswith("/" + rel)]
    if len(matches) == 1:
        return index.resolve(matches[0]) or (None, [])
    return None, []


# ----------------------------------------------------------------------------------------------------------------
# The course's text
# ----------------------------------------------------------------------------------------------------------------

def course_texts() -> list[tuple[str, str | None, str]]:
    """``(file, cell label or None, text)`` for every place the course may cite vLLM."""
    texts: list[tuple[str, str | None, str]] = []
    for folder in ("notebooks", "solutions"):
        for nb_path in sorted((REPO / folder).glob("*.ipynb")):
            cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
            for n, cell in enumerate(cells):
                if cell.get("cell_type") in ("markdown", "code"):
                    source = cell.get("source", "")
                    texts.append((f"{folder}/{nb_path.name}", f"cell {n}",
                                  "".join(source) if isinstance(source, list) else source))
    pages = [p for p in sorted((REPO / "docs").glob("*.md")) if not p.name.endswith(".zh-CN.md")]
    paths = [REPO / "README.md", REPO / "CONTRIBUTING.md", *pages, *sorted((REPO / "minillm").rglob("*.py")),
             *sorted((REPO / "kernels").rglob("*.py"))]
    for p in paths:
        texts.append((p.relative_to(REPO).as_posix(), None, p.read_text(encoding="utf-8")))
    return texts


def bad_references(index: VllmIndex) -> tuple[list[str], int]:
    """Every bad reference as ``file (cell N): reference — why``, and how many citations were checked."""
    lines: list[str] = []
    checked = 0
    for file, cell, text in course_texts():
        for cit in extract_citations(text):
            checked += 1
            for offset, ref, why in check_citation(index, cit):
                where = cell or f"line {text.count(chr(10), 0, offset) + 1}"
                line = f"{file} ({where}): {ref} — {why}"
                if line not in lines:
                    lines.append(line)
    return lines, checked


@pytest.fixture(scope="module")
def vllm_index() -> VllmIndex:
    return VllmIndex.load()


# ----------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------

def test_course_cites_only_what_vllm_0_33_0_has(vllm_index: VllmIndex) -> None:
    bad, checked = bad_references(vllm_index)
    assert checked > 50, f"only {checked} vLLM citations found: the extraction rules have stopped matching"
    assert not bad, (f"{len(bad)} references that vLLM {vllm_index.version} does not have "
                     f"(rules: tests/repo/test_vllm_references.py's docstring):\n" + "\n".join(bad))


def test_index_has_the_expected_scale(vllm_index: VllmIndex) -> None:
    assert vllm_index.version == VLLM_VERSION
    assert len(vllm_index.files) > 1000
    assert vllm_index.resolve("vllm/v1/core/sched/scheduler.py") is not None
    assert vllm_index.defines(["vllm/v1/core/sched/scheduler.py"], "Scheduler.schedule")[0]
    assert vllm_index.defines(["vllm/v1/core/sched/scheduler.py"], "Scheduler")[0]
    assert vllm_index.defines(["vllm/v1/request.py"], "RequestStatus.WAITING")[0]  # class attribute
    assert vllm_index.defines(["vllm/v1/request.py"], "Request.num_computed_tokens")[0]  # self.x in __init__
    assert vllm_index.resolve("vllm/v1/worker/gpu/") is not None  # a directory
    assert vllm_index.resolve("vllm/v1/core/sched/nope.py") is None
    assert not vllm_index.defines(["vllm/v1/core/sched/scheduler.py"], "Scheduler.no_such_method")[0]


@pytest.mark.parametrize("text, expected", [
    # What is a path
    ("see `vllm/v1/core/sched/scheduler.py`.", [["vllm/v1/core/sched/scheduler.py"]]),
    ("plain vllm/v1/request.py. Then", [["vllm/v1/request.py"]]),
    ("dir `vllm/v1/worker/gpu/` and module ``vllm/model_executor/layers/rotary_embedding``",
     [["vllm/v1/worker/gpu/"], ["vllm/model_executor/layers/rotary_embedding"]]),
    ("not paths: minillm/vllm/x.py, github.com/vllm-project/vllm/blob/main, `vllm serve`, vLLM/", []),
    # Rule 1: inline
    ("`vllm/a.py:Scheduler.schedule` and vllm/b.py::helper", [["vllm/a.py", "Scheduler.schedule"],
                                                              ["vllm/b.py", "helper"]]),
    ("`vllm/a.py Foo`", [["vllm/a.py", "Foo"]]),
    ("`python -m vllm/a.py --x`", [["vllm/a.py"]]),
    ("`vllm/a.py:12`", [["vllm/a.py"]]),
    # Rule 2: after the path
    ("| `vllm/config/scheduler.py` `SchedulerConfig` | partial", [["vllm/config/scheduler.py", "SchedulerConfig"]]),
    ("``vllm/a.py`` (``A``, ``B.c``, ``d()``) and more", [["vllm/a.py", "A", "B.c", "d"]]),
    ("`vllm/a.py`: `A`, `B`; other", [["vllm/a.py", "A", "B"]]),
    ("`vllm/a.py` (`GPUModelRunner`: `_update_states`, `execute_model`)",
     [["vllm/a.py", "GPUModelRunner", "_update_states", "execute_model"]]),
    ("`vllm/a.py` `A.b`, `_c` (the step state)", [["vllm/a.py", "A.b", "_c"]]),
    ("`vllm/a.py` (`f(..., x, y)`; rest)", [["vllm/a.py", "f"]]),
    ("`vllm/a.py` (token budget, `num_computed_tokens`)", [["vllm/a.py"]]),
    ("`vllm/a.py` (`A` with its `x`)", [["vllm/a.py", "A"]]),
    ("`vllm/a.py` (`_prep`, positions, `logits_indices`)", [["vllm/a.py", "_prep"]]),
    ("`vllm/a.py` `A` | the model; `forward`", [["vllm/a.py", "A"]]),
    ("`vllm/a.py` `A` + `vllm/b.py` `B`", [["vllm/a.py", "A"], ["vllm/b.py", "B"]]),
    ("`vllm/cli/` (`vllm serve`, `x`)", [["vllm/cli/"]]),
    ("`vllm/a.py`, `Foo` in `vllm/b.py`", [["vllm/a.py"], ["vllm/b.py", "Foo"]]),
    # Rule 3: before the path
    ("``SiluAndMul`` in ``vllm/x/activation.py``.", [["vllm/x/activation.py", "SiluAndMul"]]),
    ("``with_cancellation`` in ``vllm/e/utils.py``.", [["vllm/e/utils.py", "with_cancellation"]]),
    ("`MultiprocExecutor` (`vllm/e/mp.py`)", [["vllm/e/mp.py", "MultiprocExecutor"]]),
    ("`OpenAIServing._validate_input` (`vllm/e/se.py`)", [["vllm/e/se.py", "OpenAIServing._validate_input"]]),
    ("`logits_indices` (`vllm/w/gmr.py`)", [["vllm/w/gmr.py"]]),
    ("``vllm/c/kvu.py`` (``KVCacheBlock``, ``PrefixCacheStats`` lives in ``vllm/m/stats.py``)",
     [["vllm/c/kvu.py", "KVCacheBlock"], ["vllm/m/stats.py", "PrefixCacheStats"]]),
    ("`X` is defined in `vllm/a.py`", [["vllm/a.py", "X"]]),
    ("the group `get_pcp_group()` (`vllm/d/ps.py`)", [["vllm/d/ps.py", "get_pcp_group"]]),
    ("``S`` and ``I`` of ``vllm/m/stats.py``", [["vllm/m/stats.py", "S", "I"]]),
    ("`Mine` (`minillm/a.py`) | `vllm/a.py`", [["vllm/a.py"]]),
    ("in `_prepare_inputs`, `vllm/a.py`", [["vllm/a.py"]]),
    ("`X.y` in `vllm/a.py` (`Z`)", [["vllm/a.py", "X.y", "Z"]]),
    # Rule 4: relative files
    ("`vllm/e/llm_engine.py`, `core.py` (`EngineCore.step`), `processor.py` (input checks)",
     [["vllm/e/llm_engine.py", "+core.py", "EngineCore.step", "+processor.py"]]),
    ("`vllm/s/ops/tk.py`, `ops/penalties.py`, `logits_processor/builtin.py` | x",
     [["vllm/s/ops/tk.py", "+ops/penalties.py", "+logits_processor/builtin.py"]]),
    ("`vllm/c/kv.py`: `KVM`, with `single.py` (`FAM`, ...)", [["vllm/c/kv.py", "KVM", "+single.py", "FAM"]]),
    ("`vllm/c/kv.py`: `KVM.a`; `block_pool.py`: `BP.g`", [["vllm/c/kv.py", "KVM.a", "+block_pool.py", "BP.g"]]),
    ("`vllm/w/` (`gpu_model_runner.py`, `block_table.py`)", [["vllm/w/", "+gpu_model_runner.py", "+block_table.py"]]),
    ("`minillm/core/kv.py`, `block_pool.py` | `vllm/v1/core/`", [["vllm/v1/core/"]]),
    ("`vllm/a.py` (`A`), `B`", [["vllm/a.py", "A"]]),  # after `),` only a file may follow
])
def test_extraction_rules(text: str, expected: list[list[str]]) -> None:
    assert [c.simple() for c in extract_citations(text)] == expected


@pytest.mark.parametrize("text, historical", [
    ("`vllm/v1/a.py` (older releases: `vllm/a/`)", [False, True]),
    ("(`vllm/v1/a.py`; in older\nreleases `vllm/a.py`) or", [False, True]),
    ("(`vllm/v1/a.py`; `vllm/a/` in older releases) and", [False, True]),
    ("(newer: x; older ones, also at `vllm/a.py`: `k_2d`)", [True]),
    ("before v0.10 it was `vllm/a.py`", [True]),
    ("(``vllm/a.py``, ``p.py``; ``vllm/v1/a/`` in recent releases)", [False, False]),
    ("`vllm/a.py`. Older releases kept it elsewhere.", [False]),
])
def test_historical_clause(text: str, historical: list[bool]) -> None:
    assert [c.historical for c in extract_citations(text)] == historical


def test_checks_report_each_problem(vllm_index: VllmIndex) -> None:
    """The checks on known-good and known-bad citations, so the guard cannot pass by checking nothing."""
    def problems(text: str) -> list[str]:
        return [f"{ref} — {why}" for c in extract_citations(text) for _, ref, why in check_citation(vllm_index, c)]

    assert problems("`vllm/v1/core/sched/scheduler.py` `Scheduler.schedule`, `_preempt_request`") == []
    assert problems("`vllm/v1/core/` (`block_pool.py`: `BlockPool`)") == []
    assert problems("`vllm/v1/sample/ops/topk_topp_sampler.py`, `ops/penalties.py`") == []
    assert problems("(older releases: `vllm/attention/ops/nope.py`)") == []
    bad = problems("`vllm/v1/core/sched/schedulr.py`")
    assert len(bad) == 1 and "no such file" in bad[0]
    bad = problems("`vllm/v1/core/sched/scheduler.py` (`Scheduler.nope`)")
    assert len(bad) == 1 and "`Scheduler` there has no member `nope`" in bad[0]
    bad = problems("`vllm/v1/request.py` (`Scheduler.schedule`)")
    assert len(bad) == 1 and "class `Scheduler` is in vllm/v1/core/sched/scheduler.py" in bad[0]
    bad = problems("`Scheduler` in `vllm/v1/request.py`")
    assert len(bad) == 1 and "defined in vllm/v1/core/sched/scheduler.py" in bad[0]
    bad = problems("`vllm/v1/engine/llm_engine.py`, `no_such_file.py`")
    assert len(bad) == 1 and "no such file next to `vllm/v1/engine/`" in bad[0]
    assert problems("`vllm/v1/core/sched/scheduler.py`, `gpu_model_runner.py` (`GPUModelRunner`)") == []  # unique
    bad = problems("`vllm/v1/engine/llm_engine.py`, `processor.py`")  # gone, and not a unique name elsewhere
    assert len(bad) == 1 and "no such file next to `vllm/v1/engine/`" in bad[0]
    bad = problems("`vllm/v1/worker/nope/`")
    assert len(bad) == 1 and "no such directory" in bad[0]


# ----------------------------------------------------------------------------------------------------------------
# Deprecated and removed features: a name that outlived its feature (module docstring, "Deprecated features")
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FeaturePhrase:
    """A feature without a name of its own that 0.33.0 says is gone, with the marker it is derived from."""

    label: str
    pattern: str  # case-insensitive; English and Chinese spellings
    source: tuple[str, str, str]  # (index section, file, marked name) whose sentence says the feature is gone


FEATURE_PHRASES = (
    FeaturePhrase("cascade attention", r"cascade[\s_-]+(?:attention|attn)\b|级联\s*(?:注意力|attention)",
                  ("deprecated", "vllm/config/model.py", "ModelConfig.disable_cascade_attn")),
    FeaturePhrase("common prefix blocks", r"common[\s_-]+prefix[\s_-]+blocks?\b|公共前缀\s*(?:块|block)",
                  ("deprecated", "vllm/v1/core/sched/output.py", "SchedulerOutput.num_common_prefix_blocks")),
    FeaturePhrase("multi-step scheduling", r"multi[\s-]*step\s+schedul\w*|多步调度",
                  ("deprecated_in", "vllm/engine/arg_utils.py", "EngineArgs.add_cli_args")),
)

# Words that make a sentence history rather than a claim about v0.33.0.
HISTORY_WORDS_RE = re.compile(
    r"\b(?:removed|removal|deprecat\w*|gone|dropped|formerly|was|were|had|used\s+to|no\s+longer|no\s+effect"
    r"|always\s+empty|history|historical|older|earlier\s+(?:releases?|versions?)|previous\s+(?:releases?|versions?)"
    r"|prior\s+(?:releases?|versions?)|(?:until|before|up\s+to|pre-?)\s*v?\d+\.\d+)\b"
    r"|已?移除|已?删除|已?废弃|已?弃用|旧版本?|老版本|早期版本|以前|曾经?|不再|过去",
    re.I)
# Where a sentence ends: . ! ? before a space (not in "e.g." and the like), Chinese 。！？, a table cell's |,
# a blank line, and a line that starts a list item, a heading or a table row.
SENTENCE_END_RE = re.compile(
    r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)(?<!\betc)(?<!\bcf)(?<!\bNo)[.!?](?=\s|$)|[。！？]|\|"
    r"|\n[ \t]*\n|\n(?=[ \t]*(?:[-*+] |\d+[.)] |#|\|))")


def sentences(text: str) -> list[tuple[int, str]]:
    """``(offset, sentence)`` for each sentence, table cell or list item of ``text`` (see :data:`SENTENCE_END_RE`)."""
    out, start = [], 0
    for m in SENTENCE_END_RE.finditer(text):
        if text[start:m.end()].strip():
            out.append((start, text[start:m.end()]))
        start = m.end()
    if text[start:].strip():
        out.append((start, text[start:]))
    return out


@dataclass(frozen=True)
class Mention:
    """Something a sentence names that 0.33.0 marks as gone."""

    what: str  # the name, flag, path or phrase as the course wrote it
    source: str  # `file:name` of the marker
    excerpt: str  # what vLLM says there


class DeprecationGuard:
    """The names, flags, files and feature phrases of the index's markers, and the check of one sentence."""

    def __init__(self, index: VllmIndex) -> None:
        self.index = index
        self.words: dict[str, tuple[str, str]] = {}  # bare identifier -> (source, excerpt)
        self.qualified: dict[str, tuple[str, str]] = {}  # Class.member -> (source, excerpt)
        self.modules: dict[str, tuple[str, str]] = {}  # file path without .py -> (source, excerpt)
        self.flags: dict[str, tuple[str, str]] = {}  # --flag -> (source, excerpt)
        marked: dict[str, set[tuple[str, str]]] = {}  # bare word -> the marked definitions of it
        candidates: dict[str, tuple[str, str]] = {}
        for file, names in index.deprecated.items():
            for name, excerpt in names.items():
                src = (f"{file}:{name}" if name else file, excerpt)
                if name == "":
                    self.modules[file.removesuffix(".py")] = src
                elif name.startswith("--"):  # the CLI says the option is gone: the flag, and its field if distinctive
                    self.flags[name] = src
                    if "_" in name[2:].replace("-", "_").strip("_"):
                        self.words[name[2:].replace("-", "_")] = src
                else:
                    word = re.search(r"(\w+)\)?$", name).group(1)
                    marked.setdefault(word, set()).add((file, name))
                    if "(" not in name and "." in name:
                        self.qualified[name] = src
                    candidates.setdefault(word, src)
        definitions = index.definitions()
        for word, src in candidates.items():
            # A bare word is guarded when it is a distinctive identifier (it has an underscore) and every place
            # 0.33.0 defines it is marked: `num_common_prefix_blocks` is, `device` (173 definitions) is not.
            if "_" in word.strip("_") and definitions.get(word, set()) <= marked[word]:
                self.words.setdefault(word, src)
        self.phrases = [(p, re.compile(p.pattern, re.I)) for p in FEATURE_PHRASES]
        flags = {*self.flags, *(f"--{w.replace('_', '-')}" for w in self.words)}
        alternatives = [rf"(?<![\w-]){re.escape(f)}(?![\w-])" for f in sorted(flags)]
        alternatives += [rf"(?<!\w){re.escape(w)}(?!\w)" for w in self.words]
        alternatives += [rf"(?<![\w.]){re.escape(q)}(?!\w)" for q in self.qualified]
        alternatives += [rf"(?<![\w./-]){re.escape(m)}(?:\.py)?(?![\w/])" for m in self.modules]
        self.names_re = re.compile("|".join(alternatives))
        self.trigger_words = {*self.words, *(f[2:].replace("-", "_") for f in self.flags)}

    def may_mention(self, text: str) -> bool:
        """A cheap first look at a whole file or cell: ``False`` when no sentence of it can mention anything."""
        if self.trigger_words.intersection(re.findall(r"\w+", text.replace("-", "_"))):
            return True
        return (any(q in text for q in self.qualified) or any(m in text for m in self.modules)
                or any(rx.search(text) for _, rx in self.phrases))

    def mentions(self, sentence: str) -> list[Mention]:
        """What ``sentence`` names that 0.33.0 marks as gone (each once)."""
        found: dict[str, Mention] = {}
        spans: list[tuple[int, int]] = []  # the names found: a phrase inside one (`--disable-cascade-attn`) is it
        for m in self.names_re.finditer(sentence):
            spans.append(m.span())
            text = m.group(0)
            key = text.removeprefix("--").replace("-", "_")
            src = (self.qualified.get(text) or self.flags.get(text) or self.words.get(key)
                   or self.modules.get(text.removesuffix(".py")))
            if src is not None:
                found.setdefault(src[0], Mention(text, *src))
        for phrase, rx in self.phrases:
            m = next((m for m in rx.finditer(sentence) if not any(a <= m.start() < b for a, b in spans)), None)
            if m:
                section, file, name = phrase.source
                excerpt = getattr(self.index, section)[file][name]
                found.setdefault(f"{file}:{name}", Mention(m.group(0), f"{file}:{name}", excerpt))
        return list(found.values())

    def problems(self, text: str) -> list[tuple[int, str, list[Mention]]]:
        """``(offset, sentence, mentions)`` for each sentence that names a gone feature and does not say so."""
        out: list[tuple[int, str, list[Mention]]] = []
        if not self.may_mention(text):
            return out
        for offset, sentence in sentences(text):
            found = self.mentions(sentence)
            if found and not HISTORY_WORDS_RE.search(sentence):
                out.append((offset, " ".join(sentence.split()), found))
        return out


def _python_prose(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of a Python source's docstrings (``ast``) and comments (``tokenize``; a run of whole-line
    comments is one text, so a sentence may span lines)."""
    import ast
    import io
    import tokenize

    out: list[tuple[int, str]] = []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = None
    if tree is not None:
        for node in ast.walk(tree):
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                out.append((node.lineno, node.value.value))
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        tokens = []
        out.extend((n + 1, line.split("#", 1)[1]) for n, line in enumerate(source.splitlines()) if "#" in line)
    code_lines = {t.start[0] for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                                              tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)}
    last_line = -2
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        line, text = tok.start[0], tok.string.lstrip("#").strip()
        if line == last_line + 1 and line not in code_lines and out and out[-1][0] < line:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + text)
        else:
            out.append((line, text))
        last_line = line
    return out


def course_prose(may_mention=lambda text: True) -> list[tuple[str, str, str]]:
    """``(file, location, text)`` of the course's prose: markdown cells and code-cell comments of ``notebooks/`` and
    ``solutions/``, ``README*.md``, ``CONTRIBUTING*.md``, ``docs/*.md``, and the docstrings and comments of
    ``minillm/`` and ``kernels/``. A location is ``cell N (id X)`` or ``line N`` (where the text starts). Sources for
    which ``may_mention`` is false are skipped before their comments are tokenized (most of the 0.3 s this takes
    otherwise)."""
    out: list[tuple[str, str, str]] = []
    for folder in ("notebooks", "solutions"):
        for nb_path in sorted((REPO / folder).glob("*.ipynb")):
            cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
            for n, cell in enumerate(cells):
                source = cell.get("source", "")
                source = "".join(source) if isinstance(source, list) else source
                where = f"cell {n} (id {cell.get('id', '?')})"
                if cell.get("cell_type") == "markdown":
                    out.append((f"{folder}/{nb_path.name}", where, source))
                elif cell.get("cell_type") == "code" and may_mention(source):
                    out.extend((f"{folder}/{nb_path.name}", where, text) for _, text in _python_prose(source))
    pages = [*sorted(REPO.glob("README*.md")), *sorted(REPO.glob("CONTRIBUTING*.md")),
             *sorted((REPO / "docs").glob("*.md"))]
    for p in pages:
        out.append((p.relative_to(REPO).as_posix(), "line 1", p.read_text(encoding="utf-8")))
    for p in [*sorted((REPO / "minillm").rglob("*.py")), *sorted((REPO / "kernels").rglob("*.py"))]:
        source = p.read_text(encoding="utf-8")
        if may_mention(source):
            out.extend((p.relative_to(REPO).as_posix(), f"line {line}", text) for line, text in _python_prose(source))
    return out


def deprecated_feature_claims(guard: DeprecationGuard) -> list[str]:
    """Every sentence of the course that names a gone feature as current, as ``file (where): "sentence" — why``."""
    lines = []
    for file, where, text in course_prose(guard.may_mention):
        for offset, sentence, found in guard.problems(text):
            if where.startswith("line "):
                where_here = f"line {int(where[5:]) + text.count(chr(10), 0, offset)}"
            else:
                where_here = where
            why = "; ".join(f"`{m.what}`: {m.source} says \"{m.excerpt}\"" for m in found)
            lines.append(f"{file} ({where_here}): \"{sentence[:200]}\" — {why}")
    return lines


@pytest.fixture(scope="module")
def deprecation_guard(vllm_index: VllmIndex) -> DeprecationGuard:
    return DeprecationGuard(vllm_index)


def test_course_names_no_removed_feature_as_current(deprecation_guard: DeprecationGuard) -> None:
    bad = deprecated_feature_claims(deprecation_guard)
    assert not bad, (
        f"{len(bad)} sentences name what vLLM {VLLM_VERSION} marks as deprecated or removed, as if it were current. "
        "Say in the same sentence that it is gone (removed, deprecated, no longer, older releases, 已移除, 旧版本 …; "
        "rules: tests/repo/test_vllm_references.py's docstring, \"Deprecated features\"), or drop it:\n" + "\n".join(bad))


def test_index_knows_what_0_33_0_marks_as_gone(vllm_index: VllmIndex) -> None:
    """The markers the cascade-attention finding (issue 23) rests on, and look-alikes that are not markers."""
    dep = vllm_index.deprecated
    assert "cascade attention has been removed" in dep["vllm/config/model.py"]["ModelConfig.disable_cascade_attn"]
    assert "GPUModelRunner.cascade_attn_enabled" in dep["vllm/v1/worker/gpu_model_runner.py"]  # self.x + comment
    assert "always empty" in dep["vllm/v1/core/sched/output.py"]["SchedulerOutput.num_common_prefix_blocks"]
    assert "--disable-cascade-attn" in dep["vllm/engine/arg_utils.py"]  # a CLI message
    assert "GPUModelRunner._determine_batch_execution_and_padding(use_cascade_attn)" in \
        dep["vllm/v1/worker/gpu_model_runner.py"]  # a parameter, by the comment above it
    assert "multi-step scheduling has been removed" in vllm_index.deprecated_in["vllm/engine/arg_utils.py"][
        "EngineArgs.add_cli_args"]
    marked = {f"{f}:{n}" for f, names in dep.items() for n in names}
    for current in ("vllm/config/model.py:ModelConfig.allow_deprecated_quantization",  # about deprecated things
                    "vllm/v1/engine/async_llm.py:AsyncLLM.generate",  # "passing a string ... is deprecated"
                    "vllm/config/compilation.py:CompilationConfig.cudagraph_specialize_lora",  # "When ..., no effect"
                    "vllm/v1/core/sched/scheduler.py:Scheduler.schedule"):
        assert current not in marked, current
    assert len(marked) < 200, "the markers match ordinary wording: tighten MARKER_RE in scripts/vllm_index.py"


def test_feature_phrases_derive_from_markers(vllm_index: VllmIndex) -> None:
    """Each curated phrase rests on a marker of the index that names it (in its sentence or in the marked name)."""
    for phrase in FEATURE_PHRASES:
        section, file, name = phrase.source
        excerpt = getattr(vllm_index, section).get(file, {}).get(name)
        assert excerpt is not None, f"{phrase.label}: {file}:{name} is no longer marked in the index"
        assert re.search(phrase.pattern, f"{excerpt} {name}", re.I), f"{phrase.label} is not what {name} marks"


def test_guarded_words_are_distinctive(deprecation_guard: DeprecationGuard) -> None:
    words = deprecation_guard.words
    for word in ("num_common_prefix_blocks", "cascade_attn_enabled", "use_cascade_attn", "disable_cascade_attn",
                 "get_num_common_prefix_blocks"):
        assert word in words, word
    for word in ("device", "block_size", "seed", "prefix", "clear_cache", "common_prefix_len"):
        assert word not in words, f"{word} is current elsewhere in vLLM {VLLM_VERSION}, so it is not guarded bare"


# The sentences of the course at commit bf28a51 (notebooks 01 cells fb8a2358 and c604216c, 02 cell 6af03344, 04 cell
# 66095d37) that issue 23 found naming cascade attention as current: the guard must fail each of them.
BF28A51_SENTENCES = [
    "vLLM's `merge_attn_states`\n(`vllm/v1/attention/ops/merge_attn_states.py`) serves other paths: cascade "
    "attention (a prefix shared by many requests,\ncomputed once) and the chunked context of MLA models.",
    "| `merge_attn_states`, `prefix_chunk_attention`: exact merge by log-sum-exp | "
    "`vllm/v1/attention/ops/merge_attn_states.py`, `triton_merge_attn_states.py` (cascade attention, MLA chunked "
    "context, context parallelism) | fused CUDA/Triton kernels |",
    "| `reshape_and_cache_torch`, `paged_attention_torch`, `PagedAttention` | `vllm/_custom_ops.py` "
    "(`reshape_and_cache_flash`), `vllm/v1/attention/backends/triton_attn.py`, `flash_attn.py` | fused CUDA/Triton "
    "kernels (chapter 3), FP8 KV cache, cascade attention for shared prefixes |",
    "| `SchedulerOutput`, `NewRequestData`, `CachedRequestData` (`minillm/core/sched/output.py`) | "
    "`vllm/v1/core/sched/output.py` | encoder inputs, grammar bitmask, connector metadata, common prefix blocks |",
]


@pytest.mark.parametrize("text", BF28A51_SENTENCES)
def test_guard_fails_the_cascade_attention_sentences_of_bf28a51(deprecation_guard: DeprecationGuard,
                                                               text: str) -> None:
    assert deprecation_guard.problems(text)


def test_guard_fails_the_notebooks_of_bf28a51(deprecation_guard: DeprecationGuard) -> None:
    """The same on the notebooks as they were at bf28a51 (issue 23), where the clone has that commit."""
    import subprocess

    def show(path: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(REPO), "show", f"bf28a51:{path}"], capture_output=True,
                                  text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    failed: dict[str, set[str]] = {}
    for nb in ("01_attention_and_chunks", "02_paged_kv_cache", "04_scheduler"):
        raw = show(f"notebooks/{nb}.ipynb")
        if raw is None:
            pytest.skip("commit bf28a51 is not in this clone (a shallow checkout)")
        for cell in json.loads(raw)["cells"]:
            if cell["cell_type"] == "markdown" and deprecation_guard.problems("".join(cell["source"])):
                failed.setdefault(nb, set()).add(cell["id"])
    assert failed == {"01_attention_and_chunks": {"fb8a2358", "c604216c"}, "02_paged_kv_cache": {"6af03344"},
                      "04_scheduler": {"66095d37"}}, failed


@pytest.mark.parametrize("text, fails", [
    # Current-feature claims: fail
    ("`SchedulerOutput.num_common_prefix_blocks` tells the runner how many blocks all requests share.", True),
    ("Pass `--disable-cascade-attn` to turn it off.", True),
    ("vLLM 用 cascade attention 一次算完共享前缀。", True),
    ("The runner checks `self.cascade_attn_enabled` first.", True),
    ("# multi-step scheduling runs several decode steps per schedule", True),
    ("Cascade attention computes a shared prefix once. It has been removed in v0.33.0.", True),  # history elsewhere
    # History: pass
    ("v0.33.0 removed cascade attention; `disable_cascade_attn` is kept but has no effect.", False),
    ("Older releases also had cascade attention for shared prefixes.", False),
    ("Cascade attention (until v0.32) computed a shared prefix once.", False),
    ("级联注意力（cascade attention）在 v0.33.0 中已移除。", False),
    ("`num_common_prefix_blocks` is always empty in v0.33.0.", False),
    # Not a mention: pass
    ("Prefix caching shares the common prefix of many requests.", False),
    ("`DeviceConfig` picks the `device`; `block_size` is 16.", False),
    ("`merge_attn_states` serves the DCP paths and MLA's chunked context.", False),
])
def test_guard_rule(deprecation_guard: DeprecationGuard, text: str, fails: bool) -> None:
    assert bool(deprecation_guard.problems(text)) == fails, deprecation_guard.problems(text)


def test_sentences_split_where_a_claim_ends() -> None:
    got = [s.strip() for _, s in sentences("A, e.g. b. C!\n| x | y |\n- item\n- two。三\n\nD")]
    assert got == ["A, e.g. b.", "C!", "|", "x |", "y |", "- item", "- two。", "三", "D"]


def _script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("vllm_index", REPO / "scripts" / "vllm_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_index_script_attaches_each_marker_to_its_name() -> None:
    """``scripts/vllm_index.py`` on a small source: every kind of marker, and wordings that are not markers."""
    source = '''
"""Module."""
OLD = 1  # Deprecated, do not use
MSG = "--old-flag is deprecated and has no effect."


class Config:
    """A config."""

    gone: bool = True
    """Deprecated: the feature has been removed, so this has no effect."""
    lora: bool = False
    """When `enable_lora` is False, this option has no effect."""
    allow_deprecated: bool = False
    """Whether to allow deprecated methods."""

    def __init__(self, x):
        # Deprecated: kept for out-of-tree runners.
        self.flag = False

        # Multi-modal support
        self.mm = None

    def run(
        self,
        # Deprecated and ignored.
        old_arg: bool = False,
        prompt: str = "",
    ):
        """Run it.

        Args:
            prompt: The prompt. Passing a raw string to this method is deprecated.
            keep: Deprecated and always 0.
        """
        # feature X has been removed; its arguments are no longer supported.
        return None
'''
    got = _script().deprecation_markers(source)
    names = {(name, kind) for name, kind, _ in got}
    assert names == {("OLD", "name"), ("--old-flag", "name"), ("Config.gone", "name"), ("Config.flag", "name"),
                     ("Config.run(old_arg)", "name"), ("Config.run(keep)", "name"), ("Config.run", "in")}, names


def test_python_prose_reads_docstrings_and_runs_of_comments() -> None:
    source = 'def f():\n    """Cascade attention computes it."""\n    # one line\n    # and the next\n    x = 1  # trailing\n'
    assert _python_prose(source) == [(2, "Cascade attention computes it."), (3, "one line\nand the next"),
                                     (5, "trailing")]
