"""The answer lint (minillm/course/exercises/lint.py): honest answers pass, answers that reach outside their exercise
are refused, and the refusal names the line and the rule.

- Every answer cell of solutions/*.ipynb (its whole source, the solution region included) and every stub of
  exercises/*.ipynb passes :func:`check_answer` for its exercise (the number from its title line: ``"4.2"``,
  ``"C9"`` for ``# Challenge 9:``).
- A table of cheats (the interpreter's internals, reflection, code from text, the course's tooling, the part the
  exercise asks for, magics, unpickling, native code, other processes) is refused, each with the rule it breaks.
- The delegating answers and the cheating students of tests/course/delegating_answers.py are refused, but for the ones
  listed here that only the tripwire and the checks can catch.
- The message names the exercise, the line and the rule, and says what an answer may import; the exercise
  notebooks' opening says the same.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from minillm.course.exercises.lint import (ALLOWED_MODULES, IMPORTS, RULES, AnswerRefused, Finding,
                                           allowed_imports_text, check_answer, lint_answer, top_level_names)

ROOT = Path(__file__).resolve().parents[2]
TITLE = re.compile(r"^\s*#\s*(?:Exercise\s+(\d+\.\d+)|Challenge\s+(\d+))\s*:")


def answer_cells(folder: str) -> list[tuple[str, str, str]]:
    """(notebook stem, exercise number, the cell's source) of every answer cell of ``folder``/*.ipynb."""
    found = []
    for path in sorted((ROOT / folder).glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            m = TITLE.match(cell.source) if cell.cell_type == "code" else None
            if m:
                found.append((path.stem, m.group(1) or f"C{m.group(2)}", cell.source))
    return found


SOLVED = answer_cells("solutions")
STUBS = answer_cells("exercises")


def test_every_notebook_has_answer_cells():
    assert len(SOLVED) >= 35 and len(STUBS) == len(SOLVED)
    assert {stem for stem, _, _ in SOLVED} == {p.stem for p in (ROOT / "solutions").glob("*.ipynb")}
    assert any(n.startswith("C") for _, n, _ in SOLVED), "no challenge found: the C<chapter> numbering changed?"


@pytest.mark.parametrize(("stem", "number", "source"), SOLVED, ids=[f"{s[:2]}-{n}" for s, n, _ in SOLVED])
def test_solution_answer_passes(stem, number, source):
    assert "### BEGIN SOLUTION" in source
    check_answer(source, number)


@pytest.mark.parametrize(("stem", "number", "source"), STUBS, ids=[f"{s[:2]}-{n}" for s, n, _ in STUBS])
def test_exercise_stub_passes(stem, number, source):
    assert "raise NotImplementedError" in source and "### BEGIN SOLUTION" not in source
    check_answer(source, number)


def test_a_solution_with_a_cheat_appended_is_refused():
    """The two tests above can fail: the same cells, one line more, are refused."""
    stem, number, source = next(c for c in SOLVED if c[1] == "2.1")
    with pytest.raises(AnswerRefused) as e:
        check_answer(source + "\nimport sys\n", number)
    assert e.value.line == len(source.splitlines()) + 1 and e.value.rule == "import"


# --- cheats ---------------------------------------------------------------------------------------------------------
# (exercise, answer, the rule of its first finding). The answer runs after the notebook's setup cells, which may have
# imported sys, inspect or os: so the forms without the import are here too.
CHEATS: list[tuple[str, str, str]] = [
    # IPython's internals
    ("10.1", "get_ipython().input_transformers_cleanup.append(lambda lines: lines)", "builtin"),
    ("10.1", "ip = get_ipython()\nip.run_cell('x = 1')", "builtin"),
    # sys.modules, importlib, gc, inspect, builtins
    ("10.1", "import sys\nsys.modules['minillm.course.exercises.tripwire'].BUILDS.clear()", "import"),
    ("10.1", "sys.modules['minillm.course.exercises.tripwire'].BUILDS.clear()", "reflection"),
    ("10.1", "t = torch.sys.modules", "reflection"),
    ("10.3", "import importlib\nimport minillm.model.parallel_layers as pl\nimportlib.reload(pl)", "import"),
    ("10.3", "again = importlib.reload(pl)", "reflection"),
    ("10.1", "import gc\nrefs = gc.get_referrers(x)", "import"),
    ("10.1", "refs = gc.get_referrers(x)", "reflection"),
    ("10.3", "import inspect\nexec(inspect.getsource(f))", "import"),
    ("10.3", "exec(inspect.getsource(f))", "builtin"),
    ("10.3", "src = inspect.getsource(f)", "reflection"),
    ("10.1", "import inspect\ng = inspect.unwrap(f)", "import"),
    ("10.1", "g = inspect.unwrap(f)", "reflection"),
    ("10.1", "b = __builtins__", "reflection"),
    ("10.1", "import builtins", "import"),
    ("10.1", "from builtins import getattr as ga", "import"),
    # work handed to another thread, where the guard does not watch; a kernel's private helpers
    ("10.1", "from minillm.engine.core import ThreadPoolExecutor", "thread"),
    ("10.1", "from minillm.engine import core\npool = core.ThreadPoolExecutor(1)", "thread"),
    ("10.1", "def f(pool):\n    return pool.submit(print, 1)", "thread"),
    ("10.4", "from kernels.compile_check import _input_jobs", "import"),
    # frames and code objects
    ("10.1", "g = f.__wrapped__", "reflection"),
    ("10.1", "c = fn.__code__", "reflection"),
    ("10.1", "g = fn.__globals__['guard']", "reflection"),
    ("10.1", "import sys\nfr = sys._getframe().f_back", "import"),
    ("10.1", "fr = sys._getframe().f_back", "reflection"),
    ("10.1", "def f(g):\n    return g.gi_frame.f_back", "reflection"),
    ("10.1", "try:\n    1 / 0\nexcept Exception as e:\n    fr = e.__traceback__.tb_frame", "reflection"),
    ("10.1", "def f(tb):\n    return tb.tb_frame.f_globals", "reflection"),
    ("10.1", "c = f.co_consts", "reflection"),
    # code from text
    ("10.1", "eval('1 + 1')", "builtin"),
    ("10.1", "exec('x = 1')", "builtin"),
    ("10.1", "c = compile('1', 'f', 'eval')", "builtin"),
    ("10.1", "m = __import__('os')", "reflection"),
    ("10.1", "import typing\nh = typing.get_type_hints(f)", "reflection"),
    ("10.1", "s = '{0.__class__}'.format(x)", "reflection"),
    ("10.1", "fmt = 'x'\ns = fmt.format(x)", "reflection"),
    # reading the package's files
    ("10.1", "t = open('minillm/worker/model_runner.py').read()", "builtin"),
    ("10.1", "import pathlib\nt = pathlib.Path('minillm/worker/model_runner.py').read_text()", "import"),
    # the course's tooling
    ("10.1", "from minillm.course.exercises import ch10", "import"),
    ("10.1", "from minillm.course.exercises.tripwire import guard", "import"),
    ("10.1", "import minillm.course.exercises.tripwire as tw", "import"),
    ("10.1", "from minillm import course", "reflection"),
    ("10.1", "guard = lambda numbers, learner: learner", "rebind"),
    ("10.1", "def check_cases(*a, **k):\n    return 1", "rebind"),
    # the part the exercise asks for: by name, import, attribute, alias, default, class attribute, partial, super()
    ("2.1", "from minillm.attention.paged import compute_slot_mapping", "target"),
    ("2.1", "from minillm.attention.paged import compute_slot_mapping as csm", "target"),
    ("2.1", "import minillm.attention.paged as p\nq = p\nf = q.compute_slot_mapping", "target"),
    ("2.1", "def my(b, s, e, n):\n    return compute_slot_mapping(b, s, e, n)", "target"),
    # 10.1's part lives in the course's tooling (minillm.course.persistent_batch): importing it is refused as such
    ("10.1", "from minillm.course.persistent_batch import update_states as ref\n"
             "def update_states(batch, requests, so):\n    return ref(batch, requests, so)", "import"),
    ("10.1", "from minillm.course import persistent_batch\n"
             "def update_states(batch, requests, so, _ref=persistent_batch.update_states):\n"
             "    return _ref(batch, requests, so)", "import"),
    ("10.1", "import minillm.course.persistent_batch as pb\ng = pb.update_states", "import"),
    ("4.2", "class S(Scheduler):\n    def _schedule_waiting(self, step):\n"
            "        return super()._schedule_waiting(step)", "target"),
    ("4.2", "class S(Scheduler):\n    def _schedule_waiting(self, step):\n"
            "        return Scheduler._schedule_waiting(self, step)", "target"),
    ("4.3", "class S(Scheduler):\n    def _allocate_or_preempt(self, r):\n        return self._preempt_request(r)",
     "target"),
    ("10.2", "from minillm.core.sched.async_scheduler import AsyncScheduler as A\nclass S(A):\n"
             "    def _update_after_schedule(self, so):\n        return super(S, self)._update_after_schedule(so)",
     "target"),
    ("9.2", "class C(SharedStorageConnector):   # inherits PromptKVConnector's\n"
            "    def get_num_new_matched_tokens(self, r, n):\n"
            "        return super().get_num_new_matched_tokens(r, n)", "target"),
    ("9.1", "def shards(mlp, r, n):\n    return MergedColumnParallelLinear([mlp.gate_proj, mlp.up_proj], r, n)",
     "target"),
    ("6.2", "def my_step(engine):\n    return engine.step()", "target"),
    ("2.5", "def my_free(pool, blocks):\n    pool.free_blocks(reversed(blocks))", "target"),
    ("3.2", "from kernels.attention_stages import _contiguous_kernel as my_kernel", "target"),
    # magics and the shell
    ("10.1", "%load_ext autoreload", "magic"),
    ("10.1", "%%capture\nx = 1", "magic"),
    ("10.1", "!pip install something", "magic"),
    ("10.1", "files = !ls minillm", "magic"),
    # attributes by name
    ("10.1", "c = getattr(f, '__co' + 'de__')", "builtin"),
    ("10.1", "name = 'x'\nc = getattr(f, name)", "builtin"),
    ("10.1", "setattr(torch, 'allclose', f)", "builtin"),
    ("10.1", "delattr(x, 'y')", "builtin"),
    ("10.1", "n = '__code__'", "reflection"),
    ("10.1", "import operator\ng = operator.attrgetter('x')", "import"),
    # namespaces
    ("10.1", "g = globals()", "builtin"),
    ("10.1", "globals()['guard'] = f", "builtin"),
    ("10.1", "v = vars(f)", "builtin"),
    ("10.1", "l = locals()", "builtin"),
    ("10.1", "def f():\n    global check_cases\n    check_cases = None", "rebind"),
    # the type system's back doors
    ("10.1", "s = object.__subclasses__()", "reflection"),
    ("10.1", "m = type(x).__mro__", "reflection"),
    ("10.1", "d = ModelRunner.__dict__", "reflection"),
    ("10.1", "C = type('C', (), {'x': 1})", "builtin"),
    ("10.1", "g = type(f)(code, {})", "reflection"),
    ("10.1", "class Always:\n    def __eq__(self, other):\n        return True", "special"),
    ("10.1", "import types\ng = types.FunctionType(code, {})", "import"),
    ("10.1", "from types import FunctionType", "import"),
    ("10.1", "import copy\nc = copy.copy(f.__code__)", "reflection"),
    # patching what the answer did not make
    ("10.1", "torch.allclose = lambda *a, **k: True", "patch"),
    ("10.1", "import torch\nt = torch\nt.allclose = lambda *a, **k: True", "patch"),
    ("10.1", "model.config.num_hidden_layers = 1", "patch"),
    # native code, other processes, unpickling
    ("10.1", "import ctypes", "import"),
    ("10.1", "import os\nos.system('ls')", "import"),
    ("10.1", "os.system('ls')", "reflection"),
    ("10.1", "import subprocess\nsubprocess.run(['ls'])", "import"),
    ("10.1", "import pickle\nx = pickle.loads(b'')", "import"),
    ("10.1", "import marshal\nc = marshal.loads(b'')", "import"),
    ("10.1", "x = torch.load('weights.pt')", "load"),
    ("10.1", "x = np.load('x.npy', allow_pickle=True)", "load"),
    ("10.1", "from torch.utils.cpp_extension import load_inline", "import"),
    ("10.1", "torch.ops.load_library('x.so')", "load"),
    ("10.1", "import torch.multiprocessing", "import"),
    ("10.1", "t = torch._C", "reflection"),
    ("10.1", "import threading", "import"),
]


@pytest.mark.parametrize(("number", "answer", "rule"), CHEATS,
                         ids=[f"{n}-{i}-{r}" for i, (n, _, r) in enumerate(CHEATS)])
def test_cheat_is_refused_with_its_rule(number, answer, rule):
    source = f"# Exercise {number}: the answer\n{answer}\n"
    with pytest.raises(AnswerRefused) as e:
        check_answer(source, number)
    assert e.value.rule == rule, f"refused for {e.value.rule}, not {rule}: {e.value}"
    assert f"(rule: {RULES[rule]})" in str(e.value)
    assert e.value.line >= 2   # the title line is line 1


def test_the_cheat_table_covers_every_rule():
    assert {rule for _, _, rule in CHEATS} == set(RULES)


# --- the cheats of tests/course/delegating_answers.py -----------------------------------------------------------------------

# Delegating answers a static reading cannot tie to the part: 1.4 runs the model's layer, whose attention calls
# ContiguousKVCache.forward (the tripwire catches it).
NOT_REFUSED_DELEGATING = {"1.4"}
# The cheating students' cells that only the checks can catch: 6.1 returns the check's own `want`, a name of the
# notebook's namespace that an honest answer could read too.
NOT_REFUSED_CHEATS = {("06_engine", "cheat_captures", "6.1")}


def _delegating():
    from tests.course.delegating_answers import CHALLENGE_DELEGATING, DELEGATING, answer_cell
    return [(n, answer_cell(n)) for n in [*DELEGATING, *CHALLENGE_DELEGATING]]


def test_delegating_answers_are_refused():
    passed = {n for n, source in _delegating() if not lint_answer(source, n)}
    assert passed == NOT_REFUSED_DELEGATING
    refused = {n: lint_answer(source, n)[0].rule for n, source in _delegating() if n not in passed}
    assert set(refused.values()) <= {"target", "import"}, refused


def test_cheating_students_are_refused():
    from tests.course.delegating_answers import CHEATS as STUDENTS, cheat_cell
    passed = {(a, s, n) for a, students in STUDENTS.items() for s, cells in students.items()
              for n, body in cells.items() if not lint_answer(cheat_cell(n, body), n)}
    assert passed == NOT_REFUSED_CHEATS


# --- the message -----------------------------------------------------------------------------------------------------

def test_the_message_names_exercise_line_and_rule():
    source = "# Exercise 2.1: slot mapping\ndef f(x):\n    return x\n\ny = sys.modules\n"
    with pytest.raises(AnswerRefused) as e:
        check_answer(source, "2.1")
    message = str(e.value)
    assert message.startswith("Exercise 2.1, line 5: `sys.modules` reaches the interpreter's internals "
                              "(rule: no reflection). An answer may import: ")
    assert e.value.line == 5 and e.value.rule == "reflection" and e.value.exercise == "2.1"
    assert isinstance(e.value, AssertionError)
    assert e.value.finding == Finding(5, 4, "reflection", "`sys.modules` reaches the interpreter's internals")
    assert message.endswith(allowed_imports_text("2.1"))


def test_a_challenge_is_named_as_such():
    with pytest.raises(AnswerRefused, match=r"^Challenge 9, line 2: .*rule: no exec, eval, open and their kin"):
        check_answer("# Challenge 9: delta\neval('1')\n", "C9")


def test_the_first_finding_is_reported_and_all_are_listed():
    source = "x = 1\nimport gc\neval('2')\n"
    findings = lint_answer(source, "2.1")
    assert [(f.line, f.rule) for f in findings] == [(2, "import"), (3, "builtin")]
    with pytest.raises(AnswerRefused, match=r"line 2: "):
        check_answer(source, "2.1")


def test_a_syntax_error_is_the_learners_own():
    with pytest.raises(SyntaxError):
        check_answer("def f(:\n", "2.1")


def test_the_capstones_import_lines_are_linted_without_a_part():
    check_answer("import torch\nfrom minillm.core import BlockPool\n", IMPORTS)
    with pytest.raises(AnswerRefused, match=r"^The import lines, line 1: .*rule: import only from the allow-list"):
        check_answer("import sys\n", IMPORTS)


def test_protected_names_are_not_rebound():
    setup = "model = load()\nfrom x import helper\n"
    assert top_level_names(setup) == {"model", "helper"}
    with pytest.raises(AnswerRefused, match=r"rule: leave the course's names alone"):
        check_answer("model = None\n", "2.1", protected=top_level_names(setup))
    check_answer("def f():\n    model = None\n    return model\n", "2.1", protected=top_level_names(setup))


def test_allowed_imports_text():
    text = allowed_imports_text("2.1")
    assert text.startswith("An answer may import: ")
    assert all(m in text for m in ALLOWED_MODULES)
    assert "not: minillm.course" in text and "minillm.attention.paged.compute_slot_mapping" in text
    chapter = allowed_imports_text(["9.1", "9.2", "C9"], markdown=True)
    assert "`minillm.course`" in chapter and "9.2: `minillm.distributed" in chapter
    assert "challenge 9: `minillm.course.exercises.challenges.ch09" in chapter
    assert "for challenge 9 also `pathlib` (`Path`)" in chapter


def test_every_exercise_notebook_says_what_an_answer_may_import():
    from minillm.course.exercises.build import ALLOWED_IMPORTS_CELL_ID
    for path in sorted((ROOT / "exercises").glob("*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        assert cells[1].cell_type == "markdown" and cells[1].id == ALLOWED_IMPORTS_CELL_ID, path.name
        numbers = [n for stem, n, _ in STUBS if stem == path.stem]
        assert allowed_imports_text(numbers, markdown=True) in cells[1].source, path.name
