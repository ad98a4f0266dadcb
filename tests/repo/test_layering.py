"""The package's layers only point down, so its tree reads as the engine's diagram: every import in the package, lazy
and ``TYPE_CHECKING`` ones included, read from the source with ``ast``."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "minillm"

# The engine's lower rooms: what runs inside the engine core and the worker. They may import each other, and the wire
# types of ``minillm/engine/__init__.py`` (as vLLM's ``vllm/v1/core/sched/scheduler.py`` imports
# ``vllm.v1.engine.EngineCoreOutput``), but nothing of the engine above them, nor the entry points, nor the course.
LOWER = ("core", "worker", "executor", "model", "attention", "sample", "spec_decode")
ABOVE = ("minillm.engine.", "minillm.entrypoints", "minillm.course", "minillm.cli")


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``; ``from a import b`` gives ``a``, and ``a.b`` too where ``b`` is
    a module of its own (``from minillm.engine import EngineCoreOutput`` imports the package, not a submodule)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if _is_module(f"{node.module}.{a.name}")]
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _modules(*rooms: str) -> list[Path]:
    return sorted(p for room in rooms for p in (PACKAGE / room).rglob("*.py"))


def test_the_imports_are_read():
    # The checks below would pass on an empty list: make sure the reader finds imports, lazy ones included.
    found = {m for _, m in _imports(PACKAGE / "engine" / "core.py")}
    assert {"minillm.engine.parts", "minillm.core.sched.scheduler", "kernels"} <= found
    lazy = {m for _, m in _imports(PACKAGE / "cli.py")}
    assert "minillm.course.benchmarks.throughput" in lazy  # imported inside a function


@pytest.mark.parametrize("path", _modules(*LOWER), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_core_and_the_worker_never_import_the_engine(path):
    upward = [f"line {line}: {m}" for line, m in _imports(path) if m.startswith(ABOVE)]
    assert not upward, (f"{path.relative_to(ROOT)} imports a layer above it ({'; '.join(upward)}): hand the engine's "
                        f"parts down as arguments (EngineParts.scheduler_fns / model_runner_fns) instead")


def test_only_the_course_imports_the_course():
    # The one exception: `python -m minillm bench` runs the course's benchmark, imported when the command runs.
    allowed = {PACKAGE / "cli.py"}
    offenders = [f"{p.relative_to(ROOT)} line {line}: {m}"
                 for p in sorted(PACKAGE.rglob("*.py")) if PACKAGE / "course" not in p.parents and p not in allowed
                 for line, m in _imports(p) if m.startswith("minillm.course")]
    assert not offenders, "the engine imports the course's tooling:\n" + "\n".join(offenders)


def test_the_course_tooling_lives_in_one_place():
    # What moved out of the engine's rooms (issue 25): nothing of it is left beside the engine.
    for gone in ("widgets", "exercises", "analysis", "benchmarks", "core/sched/fake_runner.py",
                 "core/sched/simple_runner.py"):
        assert not (PACKAGE / gone).exists(), f"minillm/{gone} belongs under minillm/course/"
    assert {p.name for p in (PACKAGE / "course").iterdir()} >= {"widgets", "exercises", "analysis", "benchmarks",
                                                                "fake_runner.py", "simple_runner.py"}
