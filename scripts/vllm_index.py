"""Write the index of vLLM's source that ``tests/repo/test_vllm_references.py`` checks the course's citations against.

The course maps to one vLLM release, v0.33.0: every vLLM path, class and behaviour it names is checked against that
release's source. The test must run offline and fast, so instead of the 340 MB wheel it reads a small committed index:
every ``vllm/**/*.py`` path, and for each file the names a learner could look for there. The index is made with ``ast``
only: vLLM is never imported (or installed).

How to run it (from the repository root)::

    d=$(mktemp -d) && pip download vllm==0.33.0 --no-deps -d $d && (cd $d && unzip -q vllm-0.33.0-*.whl)
    python scripts/vllm_index.py $d --version 0.33.0      # writes tests/data/vllm-0.33.0-index.json

``$d`` is the directory holding the unpacked ``vllm/`` package (the wheel's root). Re-run it, and change the
version the test reads, when the course moves to another release.

Format: JSON, one line per file, sorted, so that the committed file stays small (about 1.75 MB) and a diff between
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

Quoted lines (``"quotes"``, last). The course states v0.33.0's defaults, and they depend on the platform: each
statement rests on the source line that sets the value (:data:`QUOTES`: a key, the file, the function, the lines).
The script finds every run of lines inside its function and records the line number, or stops with the key, so a
release that moves or drops one cannot be indexed without the statement being looked at again::

    "quotes": {
     "cpu_async_scheduling_off": {"line": 347, "lines": ["# async scheduling is not required on CPU", ...],
                                  "where": "vllm/platforms/cpu.py:CpuPlatform.check_and_update_config"}, ...}

Deprecation markers (``"deprecated"`` and ``"deprecated_in"``, after ``"files"``, one line per file). A name can
outlive its feature: v0.33.0 still defines ``ModelConfig.disable_cascade_attn`` ("Deprecated: cascade attention
has been removed, so this has no effect"), so the names check alone passes a course that teaches cascade attention
as current. The index therefore also records what 0.33.0's own text marks as deprecated, removed or without effect,
with the sentence that says so (cut to 120 characters)::

    "deprecated": {
     "vllm/config/model.py": {"ModelConfig.disable_cascade_attn": "Deprecated: cascade attention has been ..."},
     "vllm/engine/arg_utils.py": {"--disable-cascade-attn": "--disable-cascade-attn is deprecated and ..."},
     "vllm/v1/worker/gpu_model_runner.py": {"GPUModelRunner._determine_batch_execution_and_padding(use_cascade_attn)":
                                            "Deprecated and ignored. ...", "GPUModelRunner.cascade_attn_enabled": ...},
     ...},
    "deprecated_in": {
     "vllm/engine/arg_utils.py": {"EngineArgs.add_cli_args": "multi-step scheduling has been removed; ..."}, ...}

- A *marker* is a sentence matching :data:`MARKER_RE`: it says the documented thing itself is deprecated, has been
  removed, will be removed, has no effect (unconditionally: "When `x` is False, this option has no effect" is not
  one), is always empty or is no longer used. Wordings about other things ("allow deprecated quantization
  methods", "passing a string to this method is deprecated", "metrics that were deprecated") are not markers.
- Where they are read: docstrings (``ast``) and comments (``tokenize``), and messages naming a command-line flag
  (``"--disable-cascade-attn is deprecated ..."``, any string constant).
- The name a marker is attached to (the key in ``"deprecated"``), in the names' own form:
  a docstring's first paragraph (or a later one that opens with "Deprecated") documents its function or class
  (``Class.method``); a field docstring (a string right after an assignment) documents the field (``Class.field``);
  an ``Args:``/``Attributes:`` entry documents a parameter, written ``function(param)``, or an attribute
  (``Class.attr``); a trailing comment documents the statement on its line, a run of whole-line comments the
  statement right below it (no blank line between): an assignment (``NAME``, ``Class.field``, ``self.x`` as
  ``Class.x``), a ``def``/``class``, or a parameter on its own line (``Class.method(param)``). A module docstring
  documents the file: key ``""``. A flag keeps its dashes (``--disable-cascade-attn``).
- A marker that documents none of these (a comment inside a function body, a later docstring paragraph) goes to
  ``"deprecated_in"`` under the innermost function or class around it (``""``: the module). Those name no API; they
  are where features without a name of their own are said to be gone ("multi-step scheduling has been removed"),
  the source of the test's curated feature phrases.
Only top-level names and the members of top-level classes are attached, as in ``"files"``.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
from collections.abc import Iterator
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


def _self_assignments(cls: ast.ClassDef) -> Iterator[tuple[ast.stmt, str]]:
    """``(assignment, x)`` for each ``self.x = ...`` in the class's own methods (``self`` is the first parameter:
    usually `self`; `cls` for classmethods, which set class attributes)."""
    for stmt in cls.body:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) or not stmt.args.args:
            continue
        self_name = stmt.args.args[0].arg
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
                        yield node, sub.attr


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """``self.x`` names assigned in the class's own methods (instance attributes, the state a learner reads)."""
    return {attr for _, attr in _self_assignments(cls)}


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


# ----------------------------------------------------------------------------------------------------------------
# Deprecation markers: what 0.33.0 says is deprecated, removed or without effect, and the name it says it of
# ----------------------------------------------------------------------------------------------------------------

# A marker says the documented thing itself is going or gone. Each alternative is worded so that the ordinary
# uses of the words do not match: "Whether to allow deprecated quantization methods" (a current option about
# deprecated things), "Passing a raw prompt string directly to this method is deprecated" (one use of a current
# method), "The "lm-format-enforcer" backend is deprecated" (one value of a current option), "this setting has no
# effect there" (an option that works elsewhere), "metrics that were deprecated in a previous release" and "block 0
# is always empty" are not markers; "Deprecated: cascade attention has been removed, so this has no effect",
# "# Deprecated, do not use", "X is deprecated. Use Y instead" and "kept for backward compatibility; no longer used"
# are.
_NOT_OBJECT = r"(?<!\bto\s)(?<!\bon\s)(?<!\bof\s)(?<!\bin\s)(?<!\bfor\s)(?<!\bwith\s)(?<!\bby\s)"
MARKER_RE = re.compile(
    r"^\W*deprecated\b"                               # "Deprecated: ...", "[DEPRECATED] ...", "# deprecated, use"
    rf"|{_NOT_OBJECT}\b(?:this|it|these|they)\s+(?:\w+\s+)?(?:is|are|has\s+been|have\s+been)\s+(?:now\s+)?"
    r"deprecated\b"                                   # "This parameter is deprecated", "it is now deprecated"
    r"|(?:^|[.;:]\s+)[\w`'\"]+\s+(?:is|are|has\s+been|have\s+been)\s+(?:now\s+)?deprecated\b"  # "NAME is deprecated"
    r"|\b(?:has|have)\s+been\s+removed\b(?!\s+from)"  # "cascade attention has been removed", not "... from X"
    rf"|{_NOT_OBJECT}(?<!\bwhen\s)(?<!\bonce\s)(?<!\bafter\s)(?<!\bbefore\s)(?<!\bif\s)"
    r"\b(?:this|it)\s+(?:\w+\s+)?will\s+be\s+removed\b(?!\s+from)"      # "It will be removed in v0.33.0"
    rf"|(?P<no_effect>{_NOT_OBJECT}\b(?:this|it)\s+(?:\w+\s+)?(?:has|have)\s+no\s+effect\b"
    r"(?!\s+(?:when|if|unless|with|without|on|for|in|there|under|during|outside|except|beyond)))"
    r"|\bso\s+(?:this|it)\s+is\s+always\s+empty\b"    # "so this is always empty"
    r"|\bno\s+longer\s+(?:used|supported|has\s+any\s+effect)\b",   # "kept for compatibility; no longer used"
    re.I)
# A command-line flag a message calls deprecated: "--disable-cascade-attn is deprecated", "x (--x) is deprecated".
FLAG_MARKER_RE = re.compile(r"(?<![\w-])(--[a-z0-9][\w-]*)\)?\s+is\s+(?:now\s+)?deprecated\b", re.I)
EXCERPT_CHARS = 120  # the sentence quoted in the index and in the test's message, cut to this length


def _excerpt(text: str, match: re.Match) -> str:
    """The sentence of ``text`` where ``match`` starts, and what follows, on one line, cut to :data:`EXCERPT_CHARS`."""
    start = text.rfind(". ", 0, match.start())
    out = " ".join(text[0 if start < 0 else start + 2:].split())
    return out if len(out) <= EXCERPT_CHARS else out[:EXCERPT_CHARS - 1].rstrip() + "…"


LEADING_DEPRECATED_RE = re.compile(r"\W*(?:\.\.\s+)?deprecated\b", re.I)  # "Deprecated: ...", ".. deprecated::"
CONDITION_RE = re.compile(r"\b(?:when|if|unless)\b", re.I)  # "When `enable_lora` is False, this has no effect"


def _marker(text: str) -> str | None:
    """The excerpt of ``text`` if it holds a marker, else ``None``."""
    flat = " ".join(text.split())
    for m in MARKER_RE.finditer(flat):
        if m.group("no_effect"):  # "has no effect" under a condition is a fact about a current option
            start = flat.rfind(". ", 0, m.start())
            start = 0 if start < 0 else start + 2
            end = flat.find(". ", m.end())
            if CONDITION_RE.search(flat[start:end if end >= 0 else len(flat)]):
                continue
        return _excerpt(flat, m)
    return None


def _docstring_of(body: list[ast.stmt]) -> str | None:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.value.value
    return None


class _Lines:
    """What each source line documents: the names a statement there defines, and the scope it lies in."""

    def __init__(self, tree: ast.Module) -> None:
        self.names: dict[int, list[str]] = {}    # line -> names a comment on (or just above) it documents
        self.scopes: list[tuple[int, int, str]] = []   # (first, last line, qualname) of each def/class
        self.docs: list[tuple[str, str, str]] = []   # (name, "function"/"class"/"field", docstring)
        self._scope(tree.body, "")

    def _add(self, first: int, last: int, name: str) -> None:
        for line in range(first, last + 1):
            self.names.setdefault(line, []).append(name)

    def _scope(self, body: list[ast.stmt], prefix: str) -> None:
        stmts = list(_walk_scope(body))
        for k, stmt in enumerate(stmts):
            names = [prefix + n for n in _bound_names(stmt)]
            if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for n in names:
                    self._add(stmt.lineno, stmt.end_lineno or stmt.lineno, n)
                nxt = stmts[k + 1] if k + 1 < len(stmts) else None
                if (nxt is not None and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):  # a field docstring (PEP 257's attribute docstring)
                    self.docs.extend((n, "field", nxt.value.value) for n in names)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = prefix + stmt.name
                self.scopes.append((stmt.lineno, stmt.end_lineno or stmt.lineno, qual))
                doc = _docstring_of(stmt.body)
                if doc is not None:
                    self.docs.append((qual, "class" if isinstance(stmt, ast.ClassDef) else "function", doc))
                if isinstance(stmt, ast.ClassDef):
                    self._add(stmt.lineno, stmt.lineno, qual)
                    if not prefix:  # members of top-level classes, as the names index does
                        self._scope(stmt.body, qual + ".")
                        self._methods(stmt, qual)
                else:
                    self._add(stmt.lineno, stmt.lineno, qual)
                    args = stmt.args
                    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                        if arg.arg not in ("self", "cls"):
                            self.names.setdefault(arg.lineno, []).insert(0, f"{qual}({arg.arg})")

    def _methods(self, cls: ast.ClassDef, qual: str) -> None:
        """``self.x = ...`` in the class's methods documents ``Class.x`` (``self.cascade_attn_enabled = False``)."""
        for node, attr in _self_assignments(cls):
            self._add(node.lineno, node.end_lineno or node.lineno, f"{qual}.{attr}")

    def scope_of(self, line: int) -> str:
        """The innermost def/class around ``line`` (``""``: the module)."""
        inner = [(first, q) for first, last, q in self.scopes if first <= line <= last]
        return max(inner)[1] if inner else ""


def _comments(source: str) -> tuple[list[tuple[int, int, bool, str]], set[int]]:
    """``(first line, last line, trailing, text)`` per comment (a run of whole-line comments is one comment), and
    the lines that hold code."""
    out: list[tuple[int, int, bool, str]] = []
    code_lines: set[int] = set()
    comments: list[tuple[int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments.append((tok.start[0], tok.string.lstrip("#").strip()))
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                  tokenize.ENDMARKER, tokenize.ENCODING):
                code_lines.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        return [], set()
    for line, text in comments:
        trailing = line in code_lines
        if (not trailing and out and not out[-1][2] and out[-1][1] == line - 1):
            first, _, _, prev = out[-1]
            out[-1] = (first, line, False, f"{prev} {text}")
        else:
            out.append((line, line, trailing, text))
    return out, code_lines


# A docstring section whose entries document parameters or attributes (Google style), and an entry in it.
SECTION_RE = re.compile(r"^(\s*)(?:Args|Arguments|Parameters|Params|Keyword Args|Attributes|Fields)\s*:\s*$")
ENTRY_RE = re.compile(r"^(\s*)\**(\w+)\s*(?:\([^)]*\))?\s*:(.*)$")


def _doc_parts(doc: str) -> tuple[list[str], list[tuple[str, str]]]:
    """A docstring's paragraphs outside its Args/Attributes sections, and ``(entry name, text)`` per entry in them."""
    paragraphs: list[list[str]] = [[]]
    entries: list[tuple[str, list[str]]] = []
    section_indent: int | None = None
    entry_indent: int | None = None
    for line in doc.expandtabs().splitlines():
        indent = len(line) - len(line.lstrip())
        if section_indent is not None and line.strip() and indent <= section_indent:
            section_indent = entry_indent = None  # the section ended: back to prose
        if section_indent is None:
            m = SECTION_RE.match(line)
            if m:
                section_indent = len(m.group(1))
                paragraphs.append([])
            elif line.strip():
                paragraphs[-1].append(line.strip())
            elif paragraphs[-1]:
                paragraphs.append([])
            continue
        m = ENTRY_RE.match(line)
        if m and (entry_indent is None or len(m.group(1)) <= entry_indent):
            entry_indent = len(m.group(1))
            entries.append((m.group(2), [m.group(3).strip()]))
        elif entries and line.strip():
            entries[-1][1].append(line.strip())
    return ([" ".join(p) for p in paragraphs if p], [(n, " ".join(t)) for n, t in entries])


def _doc_markers(name: str, what: str, doc: str) -> list[tuple[str, str, str]]:
    """``(name, kind, excerpt)`` for one docstring: the first paragraph is about ``name``; an Args/Attributes entry
    is about that parameter (``f(param)``) or attribute (``Class.attr``); any other paragraph is ``in`` it."""
    paragraphs, entries = _doc_parts(doc)
    found = []
    for k, paragraph in enumerate(paragraphs):
        if ex := _marker(paragraph):  # later paragraphs are about the name too when they open with "Deprecated"
            found.append((name, "name" if k == 0 or LEADING_DEPRECATED_RE.match(paragraph) else "in", ex))
    owner = name if what == "class" else name.rpartition(".")[0] if what == "field" else None
    for entry, text in entries:
        if ex := _marker(text):
            target = f"{name}({entry})" if owner is None else f"{owner}.{entry}" if owner else entry
            found.append((target, "name", ex))
    return found


def deprecation_markers(source: str, filename: str = "<vllm>") -> list[tuple[str, str, str]]:
    """``(name, kind, excerpt)`` for each marker of one file (see the module docstring, "Deprecation markers")."""
    tree = ast.parse(source, filename=filename)
    lines = _Lines(tree)
    found: dict[tuple[str, str], str] = {}
    module_doc = _docstring_of(tree.body)
    docs = [("", "module", module_doc)] if module_doc is not None else []
    for name, what, doc in [*docs, *lines.docs]:
        for target, kind, ex in _doc_markers(name, what, doc):
            found.setdefault((target, kind), ex)
    for node in ast.walk(tree):  # "--disable-cascade-attn is deprecated and has no effect ..." (a CLI message)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in FLAG_MARKER_RE.finditer(node.value):
                found.setdefault((m.group(1), "name"), _excerpt(node.value, m))
    comments, code_lines = _comments(source)
    for first, last, trailing, text in comments:
        ex = _marker(text)
        if ex is None:
            continue
        if trailing:
            names = lines.names.get(first, [])
        else:  # a whole-line comment documents the statement right below it (no blank line between)
            names = lines.names.get(last + 1, []) if last + 1 in code_lines else []
        if names:
            found.setdefault((names[0], "name"), ex)
        else:
            found.setdefault((lines.scope_of(first), "in"), ex)
    return [(name, kind, ex) for (name, kind), ex in sorted(found.items())]


# Source lines the course's statements about v0.33.0's defaults rest on: key -> (file, function, lines). Defaults
# depend on the platform (the platform hook has the last word), so each statement is tied to the line that sets it;
# ``build_index`` finds each run of lines (stripped, consecutive) inside its function and records where, or stops.
# ``tests/repo/test_platform_defaults.py`` checks the course's text and minillm's behaviour against these.
QUOTES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "gpu_async_scheduling_on": ("vllm/config/vllm.py", "VllmConfig.__post_init__", (
        "elif self.scheduler_config.async_scheduling is None:",
        "# Enable async scheduling unless there is an incompatible option.")),
    "async_scheduling_set_true": ("vllm/config/vllm.py", "VllmConfig.__post_init__", (
        "else:", "self.scheduler_config.async_scheduling = True")),
    "platform_hook_last": ("vllm/config/vllm.py", "VllmConfig.__post_init__", (
        "current_platform.check_and_update_config(self)",)),
    "cpu_async_scheduling_off": ("vllm/platforms/cpu.py", "CpuPlatform.check_and_update_config", (
        "# async scheduling is not required on CPU", "scheduler_config.async_scheduling = False")),
    "cpu_worker_process": ("vllm/platforms/cpu.py", "CpuPlatform.check_and_update_config", (
        "# OMP requires the MP executor to function correctly, UniProc",
        "# is not supported as it is not possible to set the OMP",
        "# environment correctly",
        'parallel_config.distributed_executor_backend = "mp"')),
    "one_rank_uni": ("vllm/config/parallel.py", "ParallelConfig.__post_init__", (
        "if self.distributed_executor_backend is None and self.world_size == 1:",
        'self.distributed_executor_backend = "uni"')),
    "engine_core_process": ("vllm/envs.py", "", (
        '"VLLM_ENABLE_V1_MULTIPROCESSING": lambda: bool(',
        'int(os.getenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))')),
    "two_batches_in_flight": ("vllm/config/vllm.py", "VllmConfig.max_concurrent_batches", (
        "# Async scheduling requires 2 concurrent batches to overlap.",)),
    # Model Runner V2 is the default wherever Triton runs and the model is supported: no platform check, and the CPU
    # worker builds V2's runner (a CPUModelRunner subclass of V2's GPUModelRunner) when it is chosen.
    "v2_runner_needs_triton": ("vllm/config/vllm.py", "VllmConfig.use_v2_model_runner", (
        "if not HAS_TRITON and not current_platform.is_unspecified():",
        "logger.warning_once(",
        '"Model Runner V2 requires Triton; using the V1 model runner instead."')),
    "cpu_v2_runner": ("vllm/v1/worker/cpu_worker.py", "CPUWorker.init_device", (
        "if self.use_v2_model_runner:",
        "from vllm.v1.worker.cpu.model_runner import (",
        "CPUModelRunner as CPUModelRunnerV2,")),
}


def _function_lines(source: str, function: str) -> tuple[int, int]:
    """1-based ``(first, last)`` lines of ``function`` (``"Class.method"``, ``"name"``; ``""``: the whole module)."""
    if not function:
        return 1, source.count("\n") + 1
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.AST | None = None
    for part in function.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise KeyError(function)
        body = node.body
    return node.lineno, node.end_lineno


def find_quotes(root: Path) -> dict[str, dict[str, object]]:
    """Where each of :data:`QUOTES` stands in the unpacked release: ``{key: {"where", "line", "lines"}}``.

    Raises:
        SystemExit: a file, a function or a run of lines is not there (the statement resting on it must change).
    """
    out: dict[str, dict[str, object]] = {}
    for key, (rel, function, want) in QUOTES.items():
        path = root / rel
        if not path.is_file():
            raise SystemExit(f"quote {key!r}: no file {rel}")
        source = path.read_text(encoding="utf-8")
        try:
            first, last = _function_lines(source, function)
        except KeyError:
            raise SystemExit(f"quote {key!r}: {rel} has no {function}") from None
        lines = [line.strip() for line in source.splitlines()[first - 1:last]]
        starts = [i for i in range(len(lines) - len(want) + 1) if tuple(lines[i:i + len(want)]) == want]
        if not starts:
            raise SystemExit(f"quote {key!r}: {rel}:{function or '(module)'} no longer has the lines {list(want)}")
        out[key] = {"where": f"{rel}:{function}" if function else rel, "line": first + starts[0],
                    "lines": list(want)}
    return out


def build_index(root: Path, version: str) -> dict:
    """Index every ``vllm/**/*.py`` under ``root`` (the directory that holds the ``vllm`` package)."""
    package = root / "vllm"
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"{root} does not hold an unpacked vllm package (no {package / '__init__.py'})")
    files: dict[str, str] = {}
    deprecated: dict[str, dict[str, str]] = {}
    deprecated_in: dict[str, dict[str, str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8")
        try:
            files[rel] = index_source(source, rel)
        except SyntaxError as exc:  # keep the path (it exists), say why its names are missing
            print(f"warning: {rel}: {exc}; indexed without names", file=sys.stderr)
            files[rel] = ""
            continue
        for name, kind, excerpt in deprecation_markers(source, rel):
            (deprecated if kind == "name" else deprecated_in).setdefault(rel, {})[name] = excerpt
    return {"version": version, "files": files, "deprecated": deprecated, "deprecated_in": deprecated_in,
            "quotes": find_quotes(root)}


def dump_index(index: dict) -> str:
    """Compact JSON with one file per line, sorted, so the committed file stays small and diffs well."""
    lines = [f'{{"version": {json.dumps(index["version"])},']
    sections = [key for key in ("files", "deprecated", "deprecated_in", "quotes") if key in index]
    for n, key in enumerate(sections):
        lines.append(f" {json.dumps(key)}: {{")
        items = sorted(index[key].items())
        for k, (path, entry) in enumerate(items):
            sep = "," if k < len(items) - 1 else ""
            value = json.dumps(dict(sorted(entry.items())), ensure_ascii=False) if isinstance(entry, dict) \
                else json.dumps(entry)
            lines.append(f"  {json.dumps(path)}: {value}{sep}")
        lines.append(" }" + ("," if n < len(sections) - 1 else ""))
    lines.append("}")
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
    n_marked = sum(len(entry) for entry in index["deprecated"].values())
    n_notes = sum(len(entry) for entry in index["deprecated_in"].values())
    print(f"{out}: {len(index['files'])} files, {n_names} names, {n_marked} marked deprecated, "
          f"{n_notes} notes inside scopes, {out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
