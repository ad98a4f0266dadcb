"""Stop `make` before it builds .venv with a Python that cannot run the course (README, "Prerequisites").

The course needs Python 3.11 or newer (pyproject.toml's requires-python) and that interpreter's `venv` module with
`ensurepip`, which Debian and Ubuntu ship apart, in python3-venv / python3.X-venv: without it `python3 -m venv`
fails halfway. The Makefile runs this file with $(PYTHON) itself before `$(PYTHON) -m venv`:

    python3 scripts/check_python.py [PYTHON] [TARGET]

PYTHON is the name the user gave make (for the message) and TARGET the make goal (`lab` by default). It prints
nothing and exits 0 when the interpreter will do; else it prints what is wrong and what to do, and exits 1. (A
missing interpreter cannot run this file: the Makefile says that one itself.)

It runs on the old interpreters it is meant to refuse: Python 2.7 and 3.x alike, so no f-strings, no annotations, no
walrus (tests/repo/test_packaging.py checks).
"""
from __future__ import print_function

import sys

REQUIRED = (3, 11)
INSTALL = ("On Debian or Ubuntu: sudo apt-get install python3.11 python3.11-venv\n"
           "(Ubuntu 22.04, whose python3 is 3.10: add the deadsnakes PPA first, sudo add-apt-repository "
           "ppa:deadsnakes/ppa).\nWith pyenv, conda or uv, any Python 3.11 or newer will do: "
           "PYTHON=/path/to/python3.11.")


def _version(version_info):
    return ".".join(str(n) for n in tuple(version_info)[:3])


def problem(version_info, has_venv, python="python3", target="lab"):
    """Why `python` (reporting `version_info`, a tuple such as (3, 10, 12), and `has_venv`: whether `venv` and
    `ensurepip` import) cannot build .venv, as the message to print; None when it can."""
    found = _version(version_info)
    if tuple(version_info)[:2] < REQUIRED:
        return ("minillm needs Python {req} or newer (requires-python in pyproject.toml),\nbut PYTHON={python} is "
                "Python {found}.\nInstall Python {req} with its venv module, then name it:\n\n"
                "    make {target} PYTHON=python3.11\n\n{install}").format(
                    req="%d.%d" % REQUIRED, python=python, found=found, target=target, install=INSTALL)
    if not has_venv:
        package = "python%d.%d-venv" % tuple(tuple(version_info)[:2])
        return ("minillm builds .venv with `{python} -m venv`, but PYTHON={python} (Python {found})\nhas no venv "
                "module with ensurepip, so that would fail halfway. On Debian or Ubuntu install it,\nthen run make "
                "again:\n\n    sudo apt-get install {package}    (or python3-venv, for the system's python3)\n"
                "    make {target} PYTHON={python}").format(python=python, found=found, package=package, target=target)
    return None


def _has_venv():
    try:
        import ensurepip  # noqa: F401  (Debian and Ubuntu leave it out without python3-venv)
        import venv  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv):
    python = argv[1] if len(argv) > 1 else "python3"
    target = argv[2] if len(argv) > 2 and argv[2] else "lab"
    message = problem(sys.version_info, _has_venv(), python, target)
    if message is None:
        return 0
    print("\n" + message + "\n", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
