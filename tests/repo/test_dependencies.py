"""The engine's hard dependencies are what the engine imports; the [course] extra covers what the course imports.

Every ``import`` is read with ``ast`` (those inside functions too): ``minillm/`` outside ``minillm/course`` and
``kernels/`` may import only the hard dependencies of pyproject.toml, and every hard dependency is imported there;
``minillm/course`` and the notebooks' code cells may import the hard dependencies and the [course] extra (nbgrader's
module also the [classroom] extra). A new import without its dependency, or a dependency nothing imports, fails here.
"""
import ast
import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"minillm", "kernels"}

# Imported, but installed by a declared distribution whose API exposes them: FastAPI's request and error types
# (pydantic, starlette), nbgrader's preprocessor base and traits (nbconvert, traitlets).
PROVIDED_BY = {"pydantic": "fastapi", "starlette": "fastapi", "nbconvert": "nbgrader", "traitlets": "nbgrader"}
# Hard dependencies that no file imports by name, and why they stay.
NOT_IMPORTED = {"tokenizers": "transformers' fast tokenizers, which AutoTokenizer (minillm/tokenizer.py) loads"}
# Imports of the engine's packages that only a course helper runs, inside the function that needs them.
LAZY_COURSE = {("kernels/trace.py", "matplotlib")}  # plot_access_comparison: chapter 3's access-map figure


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared(*extras: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) if not extras or "" in extras else []
    for extra in extras:
        if extra:
            reqs += project["optional-dependencies"][extra]
    return {_name(r) for r in reqs}


_DISTRIBUTIONS = importlib.metadata.packages_distributions()


def _distribution(module: str) -> str:
    dists = _DISTRIBUTIONS.get(module)
    return _name(dists[0]) if dists else _name(module)


def _module_level(tree: ast.Module) -> set[int]:
    """ids of the import nodes that run when the module is imported (not inside a function, nor under
    ``if TYPE_CHECKING:``)."""
    found: set[int] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.add(id(node))
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def _imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(top-level module, node) of every absolute import in ``tree``, stdlib and first-party ones left out."""
    out = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                out.append((top, node))
    return out


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _engine_files() -> list[Path]:
    return [p for p in _python_files("minillm", "kernels") if "course" not in p.relative_to(ROOT).parts[:2]]


def _missing(imports: dict[str, set[str]], allowed: set[str]) -> dict[str, list[str]]:
    """Imported distributions (-> where) that ``allowed`` does not cover, directly or through PROVIDED_BY."""
    return {dist: sorted(where) for dist, where in sorted(imports.items())
            if dist not in allowed and PROVIDED_BY.get(dist) not in allowed}


def test_the_engine_imports_only_its_hard_dependencies():
    hard, course = _declared(""), _declared("course")
    imports: dict[str, set[str]] = {}
    lazy_course = []
    for path in _engine_files():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        at_import = _module_level(tree)
        for module, node in _imports(tree):
            if (rel, module) in LAZY_COURSE:
                assert id(node) not in at_import, f"{rel} imports {module} at module level: only inside a function"
                lazy_course.append(_distribution(module))
                continue
            imports.setdefault(_distribution(module), set()).add(rel)
    missing = _missing(imports, hard)
    assert not missing, (f"the engine imports distributions that are not hard dependencies in pyproject.toml "
                         f"(add them to [project] dependencies): {missing}")
    assert set(lazy_course) <= course, f"course helpers in the engine's packages need {lazy_course} in [course]"


def test_every_hard_dependency_is_imported_by_the_engine():
    imported = {_distribution(m) for p in _engine_files() for m, _ in _imports(ast.parse(p.read_text("utf-8")))}
    unused = _declared("") - imported - set(NOT_IMPORTED)
    assert not unused, (f"hard dependencies the engine never imports (move them to the extra that needs them, "
                        f"[course] or [dev]): {sorted(unused)}")


def test_the_course_extra_covers_the_course_tooling():
    course, classroom = _declared("", "course"), _declared("classroom")
    missing: dict[str, list[str]] = {}
    for path in _python_files("minillm/course"):
        rel = path.relative_to(ROOT).as_posix()
        # The teachers' nbgrader module may also use the [classroom] extra (it imports nbgrader inside functions).
        allowed = course | classroom if rel == "minillm/course/exercises/nbgrader.py" else course
        imports = {_distribution(m): {rel} for m, _ in _imports(ast.parse(path.read_text(encoding="utf-8")))}
        for dist, where in _missing(imports, allowed).items():
            missing.setdefault(dist, []).extend(where)
    assert not missing, f"minillm/course imports distributions missing from pyproject's [course] extra: {missing}"


def test_the_course_extra_covers_the_lessons():
    """What `make lab` installs runs every lesson, exercise and solution notebook: their code cells' imports."""
    allowed = _declared("", "course")
    imports: dict[str, set[str]] = {}
    for path in sorted(p for d in ("notebooks", "exercises", "solutions") for p in (ROOT / d).glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue  # an exercise's placeholder cell
            for module, _ in _imports(tree):
                imports.setdefault(_distribution(module), set()).add(path.relative_to(ROOT).as_posix())
    missing = _missing(imports, allowed)
    assert not missing, f"the notebooks import distributions missing from pyproject's [course] extra: {missing}"


def test_the_checks_can_fail():
    """The scanner sees a lazy import, and an undeclared one is reported."""
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    import gguf\ndef f():\n    import matplotlib.pyplot as plt\n"
                     "    from zmq import Context\n")
    assert sorted(m for m, _ in _imports(tree)) == ["gguf", "matplotlib", "zmq"]
    assert not _module_level(tree) & {id(n) for _, n in _imports(tree)}
    assert len(_module_level(ast.parse("import numpy\ntry:\n    import yaml\nexcept ImportError:\n    pass"))) == 2
    assert _missing({"matplotlib": {"x.py"}, "pyzmq": {"y.py"}}, {"pyzmq"}) == {"matplotlib": ["x.py"]}
    assert _distribution("zmq") == "pyzmq" and _distribution("yaml") == "pyyaml"
