"""Packaging stays consistent: environment.yml == pyproject's dependencies, constraints pin every one of them; and
`make` refuses, before it builds .venv, a Python older than pyproject's requires-python or one without venv."""
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return set(project["dependencies"]) | set(extras["course"]) | set(extras["dev"])


def test_environment_yml_lists_the_same_packages_as_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    conda_reqs = {r for r in pip_section if not r.startswith("-e")}
    py_reqs = _pyproject_requirements()
    assert conda_reqs == py_reqs, (f"environment.yml and pyproject.toml drifted apart:\n only in environment.yml: "
                                   f"{sorted(conda_reqs - py_reqs)}\n only in pyproject.toml: {sorted(py_reqs - conda_reqs)}")


def test_constraints_pin_every_dependency_and_the_cpu_torch():
    pins = {}
    for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[_name(name)] = version
    missing = sorted(_name(r) for r in _pyproject_requirements() if _name(r) not in pins)
    assert not missing, f"requirements/constraints.txt does not pin: {missing}"
    assert pins["torch"] == "2.13.0", "CI must install the CPU build of torch that lies on this disk (2.13.0)"


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme


# ---- make's Python check (scripts/check_python.py; README, "Prerequisites") -------------------------------------------

CHECK = ROOT / "scripts" / "check_python.py"
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _check_module():
    spec = importlib.util.spec_from_file_location("check_python", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_python_check_names_the_version_found_and_what_to_do():
    check = _check_module()
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert required == ">=%d.%d" % check.REQUIRED, "scripts/check_python.py and pyproject.toml disagree"
    assert check.problem((3, 11, 0), True) is None and check.problem((3, 13, 1), True) is None
    old = check.problem((3, 10, 12), True, "python3", "lab")
    for words in ("Python 3.10.12", "PYTHON=python3 ", "make lab PYTHON=python3.11", "python3.11-venv", "deadsnakes"):
        assert words in old, (words, old)
    assert "make test PYTHON=python3.11" in check.problem((3, 8, 10), True, "python3", "test")
    assert "Python 2.7.18" in check.problem((2, 7, 18, "final", 0), True, "python", "lab")
    no_venv = check.problem((3, 12, 3), False, "python3", "test")
    for words in ("Python 3.12.3", "venv", "sudo apt-get install python3.12-venv", "python3-venv",
                  "make test PYTHON=python3"):
        assert words in no_venv, (words, no_venv)


def test_python_check_runs_on_old_interpreters():
    """The check is run by the interpreter it may refuse: no syntax newer than Python 3.6 (nor than 2.7)."""
    tree = ast.parse(CHECK.read_text())
    new_syntax = [type(node).__name__ for node in ast.walk(tree)
                  if isinstance(node, (ast.JoinedStr, ast.NamedExpr, ast.AnnAssign, ast.AsyncFunctionDef))]
    new_syntax += ["annotation" for node in ast.walk(tree) if isinstance(node, ast.arg) and node.annotation]
    new_syntax += ["return annotation" for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.returns]
    assert not new_syntax, f"scripts/check_python.py must run on old Pythons: {new_syntax}"


def _recipe(makefile: str, target: str) -> list[str]:
    """The recipe lines of the rule whose target is `target` (as written in the Makefile)."""
    lines = makefile.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(target + ":"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line)
    return recipe


def _prerequisites(makefile: str, target: str) -> list[str]:
    line = next(line for line in makefile.splitlines() if line.startswith(target + ":"))
    return line.split(":", 1)[1].split()


def test_makefile_checks_python_before_building_the_venv():
    makefile = (ROOT / "Makefile").read_text()
    for stamp in ("$(STAMP)", "$(BOOK_STAMP)"):
        recipe = _recipe(makefile, stamp)
        check = [i for i, line in enumerate(recipe) if "$(CHECK_PYTHON)" in line]
        venv = [i for i, line in enumerate(recipe) if "-m venv" in line]
        assert check and venv and check[0] < venv[0], f"{stamp}: the Python check must come before `-m venv`: {recipe}"
        assert recipe[check[0]].lstrip("\t").startswith("+"), f"{stamp}: '+' runs the check under make -n too"
    assert _recipe(makefile, "check-python") == ["\t+@$(CHECK_PYTHON)"]
    for target in ("lab", "test"):
        assert _prerequisites(makefile, target)[0] == "check-python", f"`make {target}` must check Python first"
    assert _prerequisites(makefile, "setup")[0] == "check-python"
    assert "scripts/check_python.py" in makefile


def _make(*args: str, path_first: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def _fake_python3(folder: Path, version: tuple, venv: bool = True) -> Path:
    """A `python3` that runs this interpreter but reports `version`, and lacks ensurepip unless `venv`."""
    folder.mkdir(parents=True, exist_ok=True)
    code = (f"import sys, runpy; sys.version_info = {version!r}; "
            + ("" if venv else "sys.modules['ensurepip'] = None; ")
            + "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    fake = folder / "python3"
    fake.write_text(f"#!/bin/sh\nexec '{sys.executable}' -c \"{code}\" \"$@\"\n")
    fake.chmod(0o755)
    return fake


@needs_make
@pytest.mark.parametrize("target", ["lab", "test", "setup", "book"])
def test_make_stops_on_an_old_python3_on_path(tmp_path, target):
    """Ubuntu 22.04's python3 is 3.10: every set-up target stops before `python3 -m venv`, saying what to do."""
    _fake_python3(tmp_path / "bin", (3, 10, 12, "final", 0))
    venv = tmp_path / "venv"
    done = _make("-n", target, f"VENV={venv}", path_first=tmp_path / "bin")
    assert done.returncode != 0, done.stdout
    assert "is Python 3.10.12" in done.stderr and f"make {target} PYTHON=python3.11" in done.stderr, done.stderr
    assert "-m venv" not in done.stdout, done.stdout


@needs_make
def test_make_stops_on_a_python_without_venv(tmp_path):
    """Debian's python3 without python3-venv: stopped before it leaves a half-made .venv behind (a real run)."""
    fake = _fake_python3(tmp_path / "bin", (3, 11, 2, "final", 0), venv=False)
    venv = tmp_path / "venv"
    done = _make("setup", f"VENV={venv}", f"PYTHON={fake}")
    assert done.returncode != 0
    assert "has no venv module" in done.stderr and "python3.11-venv" in done.stderr, done.stderr
    assert not venv.exists()


@needs_make
def test_make_stops_on_a_missing_python(tmp_path):
    done = _make("-n", "test", f"VENV={tmp_path / 'venv'}", "PYTHON=/nonexistent/python3.11")
    assert done.returncode != 0
    assert "no Python interpreter PYTHON=/nonexistent/python3.11 found" in done.stderr, done.stderr
    assert "make test PYTHON=python3.11" in done.stderr and "python3.11-venv" in done.stderr


@needs_make
def test_make_goes_on_with_a_good_python(tmp_path):
    """With Python 3.11+ and venv the check is silent, and plain `make` still builds .venv (its default goal)."""
    venv = tmp_path / "venv"
    done = _make("-n", f"VENV={venv}", f"PYTHON={sys.executable}")
    assert done.returncode == 0, done.stderr
    assert f"{sys.executable} -m venv {venv}" in done.stdout
    assert "minillm" not in done.stderr
