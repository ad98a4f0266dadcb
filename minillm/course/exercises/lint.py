"""Before a learner's answer runs for a grade, its source is read (never run) and refused if it reaches outside the
exercise.

The tripwire (:mod:`minillm.course.exercises.tripwire`) stops an answer that *calls* the package's own implementation
of its part. But an answer is Python in the same process as its check, and Python lets code reach the check itself:
``sys.modules`` gives the tripwire's module (empty its ``BUILDS`` and nothing is guarded), a function's
``__globals__`` gives the notebook's, ``torch.allclose = lambda *a, **k: True`` makes every comparison agree, a class
with ``__eq__`` returning ``True`` equals any expected value. So, before anything runs, :func:`check_answer` parses the
answer with :mod:`ast` and raises :class:`AnswerRefused` ("Exercise 2.1, line 3: `sys.modules` reaches the
interpreter's internals (rule: no reflection). An answer may import: ...") at the first of these it finds:

- ``magic``: a line that is an IPython magic or a shell command (``%load_ext``, ``!pip``, ``x = !ls``);
- ``import``: an import outside :data:`ALLOWED_MODULES` (``sys``, ``inspect``, ``minillm.course``, ``import minillm``);
- ``target``: any use of what the exercise asks you to build (for 2.1: ``compute_slot_mapping``), by name, import or
  attribute; for a method (4.2: ``Scheduler._schedule_waiting``), the method read off its class under any name
  (``MR = ModelRunner``, ``from ... import ModelRunner as MR``, ``model_runner.ModelRunner``) or off any object but
  ``self`` (``engine.step()`` for 6.2), ``self.m`` in a subclass that inherits it, and ``super().m`` in a class
  deriving from its class or from a package class that inherits it (found by reading the package's source:
  ``SharedStorageConnector`` for 9.2); for a constructor (9.1), the class's name;
- ``builtin``: ``exec``, ``eval``, ``compile``, ``open``, ``getattr``, ``globals``, ``get_ipython`` and their kin, and
  ``type(name, bases, namespace)``;
- ``reflection``: a dunder (``__globals__``, ``__builtins__``, ``"{0.__class__}"``, ``case object(__class__=c)``), a
  frame or code attribute (``f_back``, ``co_consts``), a module that reaches the interpreter (``torch.sys``,
  ``inspect`` imported by the notebook), ``minillm.course``, ``torch._C``, a ``.format`` on a string not written out;
- ``special``: a special method other than ``__init__``, ``__post_init__`` and ``__repr__`` (``__eq__`` can make a
  wrong answer equal the expected one);
- ``rebind``: binding ``guard``, ``check_cases`` or ``building`` (or the names a caller protects);
- ``patch``: changing an attribute or item of something the answer did not make (``torch.allclose = ...``,
  ``model.config.x = ...``);
- ``load``: unpickling (``torch.load``, ``numpy.load``) and native code (``torch.utils.cpp_extension``,
  ``load_library``).

A ``SyntaxError`` is not a refusal: it is the learner's own error, raised as it is.

What a static reading cannot stop (a determined student's remaining routes, for the teacher who reads answers):
aliasing a module or a package object in a way the lint does not follow (a default argument, a loop variable, a
tuple: ``for t in [torch]: t.allclose = f``; ``t = torch; t.allclose = f`` is refused), methods that change shared
objects (``model.register_forward_hook``, in-place tensor ops on a setup cell's tensors), reaching the part through
package code that calls it (1.4: a model layer runs ``ContiguousKVCache.forward``) or through a name the lint cannot
tie to it (an alias a lesson cell made), reading a value the check computed (a name of the notebook's namespace),
writing files where a challenge may (:data:`EXTRA`), and whatever a module on the allow-list exposes that this list
does not know about. The lint is a first line; the
tripwire and the check's own probes are the others.

vLLM has nothing like this: it is a course's device, like the tripwire.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from minillm.course.exercises.tripwire import targets_of

# The modules an answer may import. The standard library's plain-computation modules, exactly as listed (``json``
# is here for challenge 9's metadata; ``string`` is not: its ``Formatter`` reads attributes by name; ``typing`` is,
# less ``ForwardRef`` and ``get_type_hints``, which evaluate text); the tensor stack and the course's package with
# their submodules, less :data:`_REFUSED_SUBMODULES` and private ones (``torch._C``).
ALLOWED_MODULES: frozenset[str] = frozenset({
    "bisect", "collections", "collections.abc", "copy", "dataclasses", "decimal", "enum", "fractions", "functools",
    "heapq", "itertools", "json", "math", "numbers", "random", "re", "statistics", "typing",
    "torch", "numpy", "triton", "minillm", "kernels",
})
_WITH_SUBMODULES = ("torch", "numpy", "triton", "minillm", "kernels")
_REFUSED_SUBMODULES = (
    "minillm.course",             # the course's tooling: the checks, the tripwire, the challenges' references
    "torch.package", "torch.serialization", "torch.hub",   # pickles, and code fetched from elsewhere
    "torch.utils.cpp_extension", "numpy.ctypeslib", "numpy.f2py", "numpy.distutils",   # native code
    "torch.fx",                   # builds and runs Python from graph nodes that name attributes as strings
    "torch.multiprocessing",      # other processes
)
_PRIVATE_CHECKED = ("torch", "numpy", "triton", "kernels")  # private modules and attributes: internals

# Modules that reach the interpreter, the machine or other code: refused as imports, as names (a notebook's setup cell
# may have imported ``inspect`` or ``sys``; the answer must not use it) and as attribute names (``torch.sys``).
REFUSED_MODULES: frozenset[str] = frozenset({
    "sys", "os", "gc", "inspect", "importlib", "builtins", "ctypes", "subprocess", "threading", "multiprocessing",
    "concurrent", "pickle", "marshal", "types", "operator", "code", "codeop", "runpy", "io", "pathlib", "shutil",
    "signal", "socket", "IPython", "traceback", "linecache", "dis", "weakref", "atexit", "ast", "tokenize",
    "pkgutil", "site", "zipimport", "string",
})

# What one exercise needs beyond the allow-list: module -> the names it may use from it (None: any). Challenge 9
# writes the K/V files of a connector: pathlib's Path, os.replace, shutil.rmtree (the notebook imports os and shutil).
EXTRA: dict[str, dict[str, frozenset[str] | None]] = {
    "C9": {"pathlib": frozenset({"Path"}), "os": frozenset({"replace"}), "shutil": frozenset({"rmtree"}),
           "safetensors.torch": None},
}

_REFUSED_BUILTINS = frozenset({
    "exec", "eval", "compile", "__import__", "get_ipython",   # run code given as text
    "globals", "locals", "vars", "getattr", "setattr", "delattr",   # reach namespaces and attributes by name
    "open", "breakpoint", "input", "help", "memoryview",
})
# The frame, generator, traceback and code objects' attributes: the caller's namespaces and code, no dunder needed.
_FRAME_ATTRIBUTES = frozenset({
    "f_back", "f_globals", "f_locals", "f_code", "f_builtins", "f_trace", "gi_frame", "gi_code", "gi_yieldfrom",
    "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code", "tb_frame", "tb_next", "co_code", "co_consts",
    "co_names",
})
# Attribute (and imported) names refused whatever they are read from, and why.
_REFUSED_ATTRIBUTES: dict[str, tuple[str, str]] = {
    **{name: ("reflection", "reaches the interpreter's internals") for name in REFUSED_MODULES | _FRAME_ATTRIBUTES},
    "modules": ("reflection", "reaches the interpreter's internals"),   # sys.modules under another name
    "course": ("reflection", "reaches the course's tooling (the checks and their guard)"),   # minillm.course
    "fx": ("reflection", "reads attributes named by strings"),
    "ForwardRef": ("reflection", "evaluates text as code"),
    "get_type_hints": ("reflection", "evaluates text as code"),
    "make_dataclass": ("reflection", "makes a class from names given as strings"),
    "package": ("load", "unpickles"), "hub": ("load", "runs code it fetches"),
    "cpp_extension": ("load", "compiles native code"), "load_inline": ("load", "compiles native code"),
    "load_library": ("load", "loads native code"), "ctypeslib": ("load", "loads native code"),
    "f2py": ("load", "compiles native code"),
    # Threads and processes the package's modules import: the guard watches the answer's own thread, so work handed
    # to another one would run the package's part unseen.
    **{name: ("thread", "runs code on another thread or process") for name in (
        "Thread", "Timer", "ThreadPoolExecutor", "ProcessPoolExecutor", "Process", "Pool", "submit", "map_async",
        "apply_async", "start_new_thread", "to_thread", "run_in_executor", "model_thread")},
}
# Dunder attributes honest code needs: super().__init__(...), a base class's __post_init__, type(x).__name__.
_ALLOWED_DUNDER_ATTRIBUTES = frozenset({"__init__", "__post_init__", "__name__"})
# Special methods an answer may define: the rest change how Python compares, converts or looks up its objects.
_ALLOWED_SPECIAL_METHODS = frozenset({"__init__", "__post_init__", "__repr__"})
# The course's names a check cell calls: an answer that rebinds them decides its own grade.
_COURSE_NAMES = frozenset({"guard", "check_cases", "building"})
# Module names a notebook binds for its answers, so their attributes are recognised without an import in the answer.
_NOTEBOOK_MODULES = {"torch": "torch", "np": "numpy", "numpy": "numpy", "triton": "triton", "tl": "triton.language",
                     "F": "torch.nn.functional", "nn": "torch.nn", "math": "math", "json": "json"}

RULES: dict[str, str] = {
    "magic": "no IPython magics or shell commands",
    "import": "import only from the allow-list",
    "target": "the exercise asks you to write this yourself, not to call the package's part",  # the tripwire's words
    "builtin": "no exec, eval, open and their kin",
    "reflection": "no reflection",
    "special": "no special methods but __init__, __post_init__ and __repr__",
    "rebind": "leave the course's names alone",
    "patch": "change only what your answer made",
    "load": "no unpickling or native code",
    "thread": "no threads or processes",
}

_DUNDER = re.compile(r"__\w+__")
_MAGIC = re.compile(r"^\s*(?:[%!]|[\w.,\s\[\]]+=\s*[%!](?!=))")   # %magic, !shell, x = !shell, x = %magic


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing an answer must not do: where (1-based ``line``, 0-based ``col``), which :data:`RULES` id, and a
    sentence for the learner that quotes the code."""

    line: int
    col: int
    rule: str
    message: str


# The pseudo-exercise of a notebook's import lines, linted on their own by the capstone's loader in grading mode
# (:func:`minillm.course.exercises.grading.load_answers`): no part to build, the same rules otherwise.
IMPORTS = "imports"


def _what(exercise: str) -> str:
    if exercise == IMPORTS:
        return "The import lines"
    return f"Challenge {exercise[1:]}" if exercise.startswith("C") else f"Exercise {exercise}"


def _targets(exercise: str) -> list[str]:
    """The tripwire's targets of ``exercise`` ("module:qualname"); none for :data:`IMPORTS`."""
    return [] if exercise == IMPORTS else targets_of(exercise)


class AnswerRefused(AssertionError):
    """An answer reaches outside its exercise; it is not run. An ``AssertionError``, as a failed check is.

    Attributes:
        exercise: ``"2.1"`` (or a challenge, ``"C2"``); ``line``: 1-based, in the answer; ``rule``: a :data:`RULES`
        id; ``finding``: the :class:`Finding`.
    """

    def __init__(self, exercise: str, finding: Finding) -> None:
        self.exercise, self.line, self.rule, self.finding = exercise, finding.line, finding.rule, finding
        super().__init__(f"{_what(exercise)}, line {finding.line}: {finding.message} (rule: {RULES[finding.rule]}). "
                         f"{allowed_imports_text(exercise)}")


def _function_targets(exercise: str) -> dict[str, str]:
    """Name -> "module.name" of the exercise's targets that are functions or kernels (not methods)."""
    return {q: f"{m}.{q}" for m, q in (t.split(":") for t in _targets(exercise)) if "." not in q}


def _method_targets(exercise: str) -> dict[tuple[str, str], str]:
    """(class, method) -> "module.Class.method" of the exercise's targets that are methods, and of the package's
    classes that inherit such a method without overriding it (``SharedStorageConnector`` for 9.2's
    ``PromptKVConnector.get_num_new_matched_tokens``)."""
    found: dict[tuple[str, str], str] = {}
    for m, q in (t.split(":") for t in _targets(exercise)):
        if "." in q:
            owner, method = q.split(".", 1)
            for cls in _heirs(owner, method):
                found.setdefault((cls, method), f"{m}.{q}")
    return found


@functools.cache
def _package_classes() -> dict[str, list[tuple[tuple[str, ...], frozenset[str]]]]:
    """Class name -> (its bases' last names, the names its body defines) for every class of the minillm and
    kernels packages, read from their source (nothing imported)."""
    import minillm

    root = Path(minillm.__file__).resolve().parent
    classes: dict[str, list[tuple[tuple[str, ...], frozenset[str]]]] = {}
    for path in sorted([*root.rglob("*.py"), *root.parent.joinpath("kernels").rglob("*.py")]):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = tuple(b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases)
                body = frozenset([n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                                 + [t.id for n in node.body if isinstance(n, ast.Assign)
                                    for t in n.targets if isinstance(t, ast.Name)])
                classes.setdefault(node.name, []).append((bases, body))
    return classes


@functools.cache
def _heirs(owner: str, method: str) -> frozenset[str]:
    """``owner`` and the package's classes that get ``owner.method`` by inheritance (by name, transitively)."""
    heirs, todo = {owner}, [owner]
    while todo:
        base = todo.pop()
        for name, kinds in _package_classes().items():
            if name not in heirs and any(base in bases and method not in body for bases, body in kinds):
                heirs.add(name)
                todo.append(name)
    return frozenset(heirs)


def allowed_imports_text(exercise: str | Iterable[str], *, markdown: bool = False) -> str:
    """One sentence on what an answer to ``exercise`` may import, for a refusal; given several exercises (a
    chapter's), the sentence of an exercise notebook's opening, naming each exercise's part. With ``markdown``,
    module and code names are in backticks."""
    numbers = [exercise] if isinstance(exercise, str) else list(exercise)

    def c(text: str) -> str:
        return f"`{text}`" if markdown else text

    stdlib = ", ".join(c(m) for m in sorted(m for m in ALLOWED_MODULES if m not in _WITH_SUBMODULES))
    extra = "".join(
        f"; for {'this challenge' if len(numbers) == 1 else 'challenge ' + n[1:]} also "
        + ", ".join(c(m) + (f" ({', '.join(map(c, sorted(names)))})" if names else "") for m, names in EXTRA[n].items())
        for n in numbers if EXTRA.get(n))
    parts = "; ".join(f"{n if not n.startswith('C') else 'challenge ' + n[1:]}: "
                      + ", ".join(c(t.replace(":", ".")) for t in _targets(n)) for n in numbers if _targets(n))
    what = (f"the part the exercise asks you to build (for {parts})" if len(numbers) == 1
            else f"the part each exercise asks you to build ({parts})")
    refused = ", ".join(c(m) for m in _REFUSED_SUBMODULES if not m.startswith("minillm"))
    return (f"An answer may import: {stdlib}; {c('torch')}, {c('numpy')} and {c('triton')} (not their private "
            f"modules, {refused}); the names it needs from {c('minillm')} and {c('kernels')} modules "
            f"({c('from minillm.core import BlockPool')}){extra}; not: {c('minillm.course')}"
            + (f", and {what}." if parts else "."))


def top_level_names(source: str) -> set[str]:
    """The names a cell binds in the notebook's namespace: its top-level assignments, definitions and imports, and the
    names its functions declare ``global``. A caller passes those of the notebook's setup cells as ``protected``."""
    tree = ast.parse(_without_magics(source)[0])
    names = {n for node in ast.walk(tree) if isinstance(node, (ast.Global,)) for n in node.names}
    for node in _top_level_nodes(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name.split(".")[0]) for a in node.names if a.name != "*")
    return names


def _top_level_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """The nodes that run in the module's namespace: everything but the insides of functions, lambdas and classes
    (a definition's name, decorators and defaults are outside it)."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(node.decorator_list)
            if isinstance(node, ast.ClassDef):
                todo.extend([*node.bases, *node.keywords])
            else:
                todo.extend([*node.args.defaults, *(d for d in node.args.kw_defaults if d)])
        elif isinstance(node, ast.Lambda):
            todo.extend([*node.args.defaults, *(d for d in node.args.kw_defaults if d)])
        elif not isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            todo.extend(ast.iter_child_nodes(node))


def _without_magics(source: str) -> tuple[str, list[int]]:
    """The source with its magic and shell lines blanked (so the lines keep their numbers), and those lines."""
    try:
        ast.parse(source)
        return source, []   # valid Python: a line that starts with % continues an expression (a % b)
    except SyntaxError:
        pass
    lines = source.splitlines()
    magic = [i + 1 for i, line in enumerate(lines) if _MAGIC.match(line)]
    return "\n".join("" if i + 1 in magic else line for i, line in enumerate(lines)), magic


class _Linter:
    """Walks one parsed answer and collects its findings."""

    def __init__(self, source: str, exercise: str, protected: Collection[str]) -> None:
        self.source, self.exercise, self.protected = source, exercise, frozenset(protected)
        self.extra = EXTRA.get(exercise, {})
        self.functions, self.methods = _function_targets(exercise), _method_targets(exercise)
        # classes whose constructor is a target (9.1's ColumnParallelLinear): calling the class runs it
        self.constructors = {cls for cls, method in self.methods if method == "__init__"}
        self.findings: list[Finding] = []
        self.top_level: set[ast.AST] = set()   # the nodes that run in the notebook's namespace
        self.in_annotation = False

    def add(self, node: ast.AST, rule: str, message: str) -> None:
        self.findings.append(Finding(getattr(node, "lineno", 1), getattr(node, "col_offset", 0), rule, message))

    def code(self, node: ast.AST) -> str:
        """The node's source, on one line and short, for the message."""
        segment = None if self.in_annotation else ast.get_source_segment(self.source, node)
        text = " ".join((segment or ast.unparse(node)).split())
        return f"`{text if len(text) <= 60 else text[:57] + '...'}`"

    def run(self, tree: ast.Module) -> list[Finding]:
        self.top_level = set(_top_level_nodes(tree))
        self.imported: dict[str, str] = {}   # name -> the module or "module.name" an import binds it to
        self.bound: set[str] = set()          # names the answer binds otherwise (assignments, definitions, arguments)
        for node in ast.walk(tree):
            self.collect_bindings(node)
        docstrings = {id(body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      for body in [node.body] if body and isinstance(body[0], ast.Expr)}
        self.receivers: dict[int, str] = {}   # id(Name) -> the attribute read off it (os in os.replace)
        self.parents: dict[int, ast.AST] = {id(child): node for node in ast.walk(tree)
                                            for child in ast.iter_child_nodes(node)}
        # name -> the names and attribute chains assigned to it (t = torch; R = ModelRunner; kv = self.kv)
        self.aliases: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None else [])
            value = getattr(node, "value", None)
            if isinstance(value, (ast.Name, ast.Attribute)):
                for target in targets:
                    if isinstance(target, ast.Name):
                        self.aliases.setdefault(target.id, []).append(value)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                self.receivers[id(node.value)] = node.attr
        for node in ast.walk(tree):
            self.visit(node, docstrings)
            for annotation in _annotations(node):   # a string annotation is code that get_type_hints evaluates
                for const in ast.walk(annotation):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        self.annotation_text(const)
        return self.findings

    def collect_bindings(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            self.bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.bound.add(node.name)
        elif isinstance(node, ast.arg):
            self.bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            self.bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            self.bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            self.bound.add(node.rest)
        elif isinstance(node, ast.Import):
            for a in node.names:
                self.imported[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                self.imported[a.asname or a.name] = f"{node.module}.{a.name}"

    def annotation_text(self, const: ast.Constant) -> None:
        if not isinstance(const.value, str):
            return
        try:
            inner = ast.parse(const.value, mode="eval")
        except SyntaxError:
            return   # not code: nothing evaluates it
        for node in ast.walk(inner):
            ast.copy_location(node, const)
        self.in_annotation = True
        for node in ast.walk(inner):
            self.visit(node, set())
        self.in_annotation = False

    # -- the rules, by node kind -------------------------------------------------------------------------------

    def visit(self, node: ast.AST, docstrings: set[int]) -> None:
        if isinstance(node, ast.Import):
            self.visit_import(node)
        elif isinstance(node, ast.ImportFrom):
            self.visit_import_from(node)
        elif isinstance(node, ast.Name):
            self.visit_name(node)
        elif isinstance(node, ast.Attribute):
            self.visit_attribute(node)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            self.check_patch(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and id(node) not in docstrings:
            text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
            dunder = _DUNDER.search(text)
            if dunder:
                self.add(node, "reflection", f"{self.code(node)} names a dunder ({dunder.group()}): "
                                             "strings that name special attributes reach them by name")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.visit_definition(node)
        elif isinstance(node, ast.MatchClass):
            for attr in node.kwd_attrs:
                if _DUNDER.fullmatch(attr):
                    self.add(node, "reflection", f"{self.code(node)} reads {attr} through a pattern")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" \
                and "type" not in self.bound and len(node.args) + len(node.keywords) > 1:
            self.add(node, "builtin", f"{self.code(node)} makes a class from a namespace given as data: write a "
                                      "`class` statement")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and isinstance(node.func.func, ast.Name) \
                and node.func.func.id == "type" and "type" not in self.bound:
            self.add(node, "reflection", f"{self.code(node)} builds an object of a type read off another one (a "
                                         "function from a code object): name the class you build")
        elif isinstance(node, ast.Global):
            for name in node.names:
                self.check_rebind(node, name)

    def visit_import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.split(".")[0]
            why = self.module_refused(alias.name)
            if why:
                self.add(node, "import", f"{self.code(node)}: {why}")
            elif top in ("minillm", "kernels") and not alias.asname:
                self.add(node, "import", f"{self.code(node)} gives your answer the whole package: import the names "
                                         f"you need (from {alias.name if '.' in alias.name else 'minillm.core'} "
                                         f"import ...)")
            self.check_rebind(node, alias.asname or top)

    def visit_import_from(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:
            self.add(node, "import", f"{self.code(node)} is a relative import: name the module")
            return
        why = self.module_refused(module)
        if why:
            self.add(node, "import", f"{self.code(node)}: {why}")
            return
        granted = self.extra.get(module)
        for alias in node.names:
            if alias.name == "*":
                self.add(node, "import", f"{self.code(node)} imports every name: import the names you need")
            elif granted and alias.name not in granted:
                self.add(node, "import", f"{self.code(node)}: from {module}, this answer may import only "
                                         f"{', '.join(sorted(granted))}")
            elif alias.name in self.functions:
                self.add(node, "target", f"{self.code(node)}: {_what(self.exercise)} asks you to build "
                                         f"{alias.name} yourself")
            elif alias.name in self.constructors:
                self.add(node, "target", f"{self.code(node)}: {_what(self.exercise)} asks you to build what "
                                         f"{alias.name}'s constructor does yourself")
            elif alias.name in _REFUSED_ATTRIBUTES:
                rule, what = _REFUSED_ATTRIBUTES[alias.name]
                self.add(node, rule, f"{self.code(node)}: {alias.name} {what}")
            elif alias.name in ("load", "loads") and module.split(".")[0] in ("torch", "numpy"):
                self.add(node, "load", f"{self.code(node)}: {alias.name} unpickles, which can run any code")
            elif module.split(".")[0] in _WITH_SUBMODULES and self.module_refused(f"{module}.{alias.name}"):
                self.add(node, "import", f"{self.code(node)}: {self.module_refused(f'{module}.{alias.name}')}")
            self.check_rebind(node, alias.asname or alias.name)

    def module_refused(self, module: str) -> str | None:
        """Why importing ``module`` is refused, or None."""
        parts = module.split(".")
        if module in self.extra or module in ALLOWED_MODULES and parts[0] not in _WITH_SUBMODULES:
            return None
        if parts[0] in _WITH_SUBMODULES:
            refused = next((r for r in _REFUSED_SUBMODULES if module == r or module.startswith(r + ".")), None)
            if refused == "minillm.course":
                return "minillm.course is the course's tooling (the checks and their guard)"
            if refused:
                return f"{refused} is not for answers (pickles, native code or other processes)"
            if parts[0] in _PRIVATE_CHECKED and any(p.startswith("_") for p in parts[1:]):
                return f"{module} is private"
            return None
        if parts[0] in REFUSED_MODULES:
            return f"{parts[0]} reaches the interpreter's internals, files or processes"
        return f"{module} is not on the allow-list"

    def visit_name(self, node: ast.Name) -> None:
        name = node.id
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.check_rebind(node, name)
        if _DUNDER.fullmatch(name):
            self.add(node, "reflection", f"`{name}` is a dunder name: it reaches the interpreter's internals")
        elif name in self.bound:
            return   # the answer's own variable
        elif name in _REFUSED_BUILTINS:
            self.add(node, "builtin", f"`{name}` runs code from text or reaches namespaces, attributes or files "
                                      "by name")
        elif name in self.functions and name not in self.imported:
            self.add(node, "target", f"`{name}` is what {_what(self.exercise)} asks you to build yourself")
        elif name in self.constructors and name not in self.imported:
            self.add(node, "target", f"`{name}`'s constructor is what {_what(self.exercise)} asks you to build "
                                     "yourself")
        elif name in REFUSED_MODULES or name in ("ForwardRef", "get_type_hints", "make_dataclass"):
            module = self.imported.get(name, name)
            granted = self.extra.get(module)
            if granted is not None and self.receivers.get(id(node)) in granted:
                return
            if name not in self.imported:   # an import of it is refused already
                self.add(node, "reflection", f"`{name}` reaches the interpreter's internals, files or processes")

    def visit_attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.check_patch(node)
        dotted = self.dotted(node.value)
        if _DUNDER.fullmatch(attr) and attr not in _ALLOWED_DUNDER_ATTRIBUTES:
            self.add(node, "reflection", f"{self.code(node)} reaches the interpreter's internals")
        elif attr in _REFUSED_ATTRIBUTES:
            rule, what = _REFUSED_ATTRIBUTES[attr]
            self.add(node, rule, f"{self.code(node)} {what}")
        elif (attr in self.functions or attr in self.constructors) and self.made_elsewhere(node.value):
            self.add(node, "target", f"{self.code(node)}: {_what(self.exercise)} asks you to build {attr} yourself")
        elif any((cls, attr) in self.methods for cls in self.classes_of(node.value)):
            self.add(node, "target", f"{self.code(node)} is the package's {attr}: {_what(self.exercise)} asks you to "
                                     "write it yourself")
        elif self.super_target(node):
            self.add(node, "target", f"{self.code(node)} calls the package's {attr} that your class overrides: "
                                     f"{_what(self.exercise)} asks you to write it yourself")
        elif self.method_target(node):
            self.add(node, "target", f"{self.code(node)} reaches the package's {attr} on an object the answer did "
                                     f"not write it for: {_what(self.exercise)} asks you to write it yourself")
        elif attr in ("format", "format_map") and not isinstance(node.value, (ast.Constant, ast.JoinedStr)):
            self.add(node, "reflection", f"{self.code(node)}: a format string not written out can read any attribute "
                                         "by name; use an f-string")
        elif dotted and dotted.split(".")[0] in _PRIVATE_CHECKED and attr.startswith("_") \
                and not any(p.startswith("_") for p in dotted.split(".")[1:]):
            self.add(node, "reflection", f"{self.code(node)} is private: the interpreter's side of {dotted}")
        elif dotted and attr in ("load", "loads") and dotted.split(".")[0] in ("torch", "numpy"):
            self.add(node, "load", f"{self.code(node)} unpickles, which can run any code")

    def made_elsewhere(self, node: ast.AST, depth: int = 0) -> bool:
        """Whether an attribute chain's root is a name the answer did not bind (or bound by an import), or a name
        the answer assigned such a chain to (``t = torch``: ``t.allclose`` is torch's)."""
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        if not isinstance(node, ast.Name):
            return False
        if node.id not in self.bound or node.id in self.imported:
            return True
        return depth < 8 and any(self.made_elsewhere(v, depth + 1) for v in self.aliases.get(node.id, ()))

    def classes_of(self, node: ast.AST, depth: int = 0) -> set[str]:
        """The class names a receiver may stand for, when it is made elsewhere: ``ModelRunner``, ``MR`` (``from ...
        import ModelRunner as MR``), ``R`` (``R = ModelRunner``), ``model_runner.ModelRunner``."""
        if isinstance(node, ast.Name):
            if node.id in self.imported:
                return {self.imported[node.id].rsplit(".", 1)[-1]}
            if node.id not in self.bound:
                return {node.id}
            if depth < 8:
                return {c for v in self.aliases.get(node.id, ()) for c in self.classes_of(v, depth + 1)}
            return set()
        if isinstance(node, ast.Attribute) and self.made_elsewhere(node):
            return {node.attr}
        return set()

    def enclosing(self, node: ast.AST, kind: type | tuple[type, ...]) -> ast.AST | None:
        parent = self.parents.get(id(node))
        while parent is not None and not isinstance(parent, kind):
            parent = self.parents.get(id(parent))
        return parent

    def method_target(self, node: ast.Attribute) -> bool:
        """``obj.m`` where ``m`` is the name of a method target (``engine.step`` for 6.2, ``pool.free_blocks`` for
        2.5): the package's method, on whatever object the answer was given. Allowed only on ``self`` (the first
        parameter of a method) in a class that defines ``m`` itself or does not derive from the target's class."""
        owners = {cls for cls, method in self.methods if method == node.attr and not _DUNDER.fullmatch(method)}
        if not owners or not isinstance(node.value, ast.Name):
            return bool(owners) and not isinstance(node.value, ast.Call)   # super() calls: super_target
        function = self.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        cls = function and self.enclosing(function, ast.ClassDef)
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not isinstance(cls, ast.ClassDef):
            return True  # not in a method
        params = function.args.posonlyargs + function.args.args
        if not (params and node.value.id == params[0].arg):
            return True
        defines = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Assign)) and node.attr in (
            [n.name] if not isinstance(n, ast.Assign) else [t.id for t in n.targets if isinstance(t, ast.Name)])
            for n in cls.body)
        return not defines and any(owners & self.classes_of(base) for base in cls.bases)

    def super_target(self, node: ast.Attribute) -> bool:
        """``super().m`` (or ``super(C, self).m``) in a class that derives from the class of a method target
        ``m``: the package's own method, reached through the answer's subclass."""
        call = node.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "super"
                and "super" not in self.bound):
            return False
        owners = {cls for cls, method in self.methods if method == node.attr}
        parent = self.parents.get(id(node))
        while parent is not None and not isinstance(parent, ast.ClassDef):
            parent = self.parents.get(id(parent))
        if parent is None:
            return bool(owners)   # super() outside a class: refuse the name
        return any(owners & self.classes_of(base) for base in parent.bases)

    def dotted(self, node: ast.AST) -> str | None:
        """The module path an attribute chain's receiver stands for (``F.silu`` -> ``torch.nn.functional``), when
        its root is a module name the answer imported or the notebook binds; else None."""
        attrs: list[str] = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        base = self.imported.get(node.id) or (_NOTEBOOK_MODULES.get(node.id) if node.id not in self.bound else None)
        return ".".join([base, *reversed(attrs)]) if base else None

    def visit_definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.check_rebind(node, node.name)
        if _DUNDER.fullmatch(node.name) and node.name not in _ALLOWED_SPECIAL_METHODS:
            self.add(node, "special", f"`def {node.name}` changes how Python compares, converts or looks up your "
                                      "objects, which could fool a check")

    def check_rebind(self, node: ast.AST, name: str) -> None:
        if name in _COURSE_NAMES:
            self.add(node, "rebind", f"{self.code(node)} rebinds `{name}`, which the checks call")
        elif name in self.protected and (node in self.top_level or isinstance(node, ast.Global)):
            self.add(node, "rebind", f"{self.code(node)} rebinds `{name}`, which the notebook's setup defines and "
                                     "the checks may read: give yours another name")

    def check_patch(self, node: ast.Attribute | ast.Subscript) -> None:
        root: ast.AST = node
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if isinstance(root, ast.Name) and self.made_elsewhere(node):
            self.add(node, "patch", f"{self.code(node)} changes `{root.id}`, which your answer did not make")
        elif isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id in ("type", "super"):
            self.add(node, "patch", f"{self.code(node)} changes a class your answer did not make")


def _annotations(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.arg):
        return [node.annotation] if node.annotation else []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.returns] if node.returns else []
    if isinstance(node, ast.AnnAssign):
        return [node.annotation]
    return []


def lint_answer(source: str, exercise: str, protected: Collection[str] = ()) -> list[Finding]:
    """Every finding in an answer's source, in source order; ``[]`` for an answer that may run.

    Args:
        source: the answer: its exercise cell and the cells up to its check, joined by blank lines.
        exercise: ``"2.1"``, or a challenge, ``"C2"``.
        protected: more names the answer must not bind in the notebook's namespace (the names the notebook's setup
            cells bind, :func:`top_level_names`: the model, the course's check helpers); ``guard``,
            ``check_cases`` and ``building`` always are.

    Raises:
        SyntaxError: the answer does not parse (once its magic lines are blanked): the learner's own error.
    """
    plain, magic = _without_magics(source)
    tree = ast.parse(plain)
    linter = _Linter(plain, exercise, protected)
    findings = [Finding(n, 0, "magic", f"`{source.splitlines()[n - 1].strip()[:60]}` is an IPython magic or a shell "
                                       "command: an answer is plain Python") for n in magic]
    findings += linter.run(tree)
    # By position; at one position the outer node first (ast.walk goes outside in): `sys.modules` before `sys`.
    return sorted(dict.fromkeys(findings), key=lambda f: (f.line, f.col))


def check_answer(source: str, exercise: str, protected: Collection[str] = ()) -> None:
    """Raise :class:`AnswerRefused` for the first finding of :func:`lint_answer`; return if there is none.

    A ``SyntaxError`` in the answer is raised as it is (it is the learner's own error, not a refusal).
    """
    findings = lint_answer(source, exercise, protected)
    if findings:
        raise AnswerRefused(exercise, findings[0])
