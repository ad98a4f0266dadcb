"""Packaging stays consistent: environment.yml == pyproject's dependencies, constraints pin every one of them."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])


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
